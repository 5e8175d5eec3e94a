#!/bin/bash
# alternate ferro-collective's sources at 2f384bb ("new") and at 542ba0f ("old")
cd /work/main; D=benchmarks/results/0.4/2core/gathered_broadcast-2026-11-30
for r in 1 2 3 4 5 6; do
  for v in new old; do
    if [ $v = old ]; then git checkout -q 542ba0f -- packages/ferro-collective/src; else git checkout -q 2f384bb -- packages/ferro-collective/src; fi
    for n in 3 4; do
      python $D/calls.py $n shipped 100 131072,262144 broadcast | sed "s/\"mode\": \"shipped\"/\"mode\": \"$v\"/" >> $D/bcast.jsonl
    done
  done
done
git checkout -q 2f384bb -- packages/ferro-collective/src
echo AB_DONE
