#!/bin/bash
# Rounds of: the example as of e981942 (gradients and loss as one pytree: 3 calls a step), the
# example as before it and after its revert (a call per leaf and one for the loss: 7 calls), and
# --no-sync; the slower rank's median step (ms) each, then a probe of the link. Needs e981942's
# ferro-jax installed for the first (git checkout e981942 -- packages/ferro-jax examples).
# Run from the repository root: bash run_tree.sh ROUNDS
source /work/venv/bin/activate
git show e981942:examples/jax_data_parallel.py > /tmp/jax_dp_tree.py
git show ced9d7b:examples/jax_data_parallel.py > /tmp/jax_dp_leaf.py
med() { ferrorun --nproc 2 "$@" --steps 400 --out /tmp/jc.csv 2>&1 | grep -o "median [0-9.]*" | awk '{print $2}' | sort -n | tail -1; }
for i in $(seq "$1"); do
  a=$(med /tmp/jax_dp_tree.py)
  b=$(med /tmp/jax_dp_leaf.py)
  n=$(med /tmp/jax_dp_leaf.py --no-sync)
  st=$(python benchmarks/host_state.py)
  echo "$a $b $n $(python -c "print(round($a/$n,3), round($b/$n,3))") $st"
done
