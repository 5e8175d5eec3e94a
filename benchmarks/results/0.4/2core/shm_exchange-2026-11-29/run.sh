#!/bin/bash
# exchange.py with the change (new) and without it (old: the engine's rings.py and delivery.py
# of the commit before), alternating, 3 launches each; run from the repository root
for i in 1 2 3; do
  for v in new old; do
    if [ $v = old ]; then git stash push -q packages/ferro-backend/src/ferro_backend/engine; fi
    echo "# $v, launch $i"
    ferrorun --nproc 2 benchmarks/results/0.4/2core/shm_exchange-2026-11-29/exchange.py 2>&1 \
      | grep "rank 0" | sed 's/^\[rank 0\] //'
    if [ $v = old ]; then git stash pop -q; fi
  done
done
