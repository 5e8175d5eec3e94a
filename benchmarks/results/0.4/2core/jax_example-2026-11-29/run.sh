#!/bin/bash
# usage: jaxround.sh ROUNDS [extra args]; prints sync/nosync medians (slower rank) and ratio
source /work/venv/bin/activate; cd /tmp
R=$1; shift
for i in $(seq $R); do
  s=$(ferrorun --nproc 2 /work/main/examples/jax_data_parallel.py --steps 400 --out /tmp/jc.csv "$@" 2>&1 | grep -o "median [0-9.]*" | awk '{print $2}' | sort -n | tail -1)
  n=$(ferrorun --nproc 2 /work/main/examples/jax_data_parallel.py --steps 400 --no-sync --out /tmp/jc.csv "$@" 2>&1 | grep -o "median [0-9.]*" | awk '{print $2}' | sort -n | tail -1)
  st=$(python /work/main/benchmarks/host_state.py)
  echo "$s $n $(python -c "print(round($s/$n,3))") $st"
done
