#!/bin/bash
# The compiled backend's point-to-point calls, this change (new) against the commit before it
# (old), alternating: `torch_backend.py --calls --repeats 1`, 5 jobs each. Run from the repo
# root with the change in the working tree (the old sources are stashed for each old job; the
# compiled backend's cache name follows its sources, so each job loads its own build).
for i in $(seq 5); do
  for v in new old; do
    if [ $v = old ]; then git stash push -q packages/ferro-torch/src; fi
    python benchmarks/torch_backend.py --calls --repeats 1 2>&1 \
      | grep "^| \(barrier\|all_reduce 4\|send\)" | awk -F'|' -v v=$v '{print v, $2, $3, $6, $8}'
    if [ $v = old ]; then git stash pop -q; fi
  done
done
