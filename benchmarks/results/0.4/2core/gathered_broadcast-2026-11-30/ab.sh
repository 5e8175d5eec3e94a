#!/bin/bash
# alternate the tree at 8a8ea5e ("new") and at dd3b336 ("old") for ferro-collective's sources
cd /work/main; D=benchmarks/results/0.4/2core/gathered_broadcast-2026-11-30
for r in 1 2 3 4 5; do
  for v in new old; do
    if [ $v = old ]; then git checkout -q dd3b336 -- packages/ferro-collective/src; else git checkout -q 8a8ea5e -- packages/ferro-collective/src; fi
    for n in 3 4; do
      python $D/calls.py $n shipped 100 4096,65536 broadcast,gather,reduce | sed "s/\"mode\": \"shipped\"/\"mode\": \"$v\"/" >> $D/bmsg3.jsonl
    done
  done
done
git checkout -q 8a8ea5e -- packages/ferro-collective/src
echo AB_DONE
