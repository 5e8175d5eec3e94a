#!/bin/bash
# The allreduce at 8 and 16 ranks on a lent machine, for what to change in ferro's (issue 55):
# Intel MPI with each of its allreduce presets (I_MPI_ADJUST_ALLREDUCE=1..24; "default" is its
# own choice: the preset whose times match it is what it picks) and ferro's split with 1, 2 and
# 4 MiB slots, interleaved, 2 rounds. After prepare.sh, in the same call as run_peers.sh or
# alone: `OUT=$OUT BUDGET=240 bash .devpay/study_allreduce.sh` (venvs.sh makes the venvs if
# missing). Results: $OUT/study.tgz (impi.jsonl, ferro-*/results.json).
NAME=study; DEFAULT_BUDGET=240
. "$(dirname "$0")/call.sh"
bash $P/venvs.sh $PY
SIZES="65536 1048576 16777216"
for rep in 1 2; do
  for w in ${WORLDS:-8 16}; do
    cpus=0-$(( w - 1 ))
    for preset in default $(seq 1 ${PRESETS:-24}); do
      [ $(el) -gt $BUDGET ] && { echo "budget reached at $(el) s"; pack; exit 0; }
      env=""; [ $preset != default ] && env="I_MPI_ADJUST_ALLREDUCE=$preset"
      env $env I_MPI_FABRICS=shm I_MPI_PIN_PROCESSOR_LIST=$cpus timeout 30 taskset -c $cpus \
        /tmp/impi/bin/mpiexec -n $w /tmp/impi/bin/python $P/mpi_allreduce.py $SIZES \
        >> $R/impi.jsonl 2>> $R/impi.err || echo "{\"preset\": \"$preset\", \"ranks\": $w, \"failed\": true}" >> $R/impi.jsonl
    done
    for slot in 1m 2m 4m; do
      [ $(el) -gt $BUDGET ] && { echo "budget reached at $(el) s"; pack; exit 0; }
      FERRO_SHM_SLOT_BYTES=$slot timeout 60 taskset -c $cpus /tmp/fv/bin/python benchmarks/peers.py \
        --worlds $w --impls ferro-shm --ops allreduce --sizes $SIZES --repeat 1 --no-host-probe \
        --timeout 50 --out $R/ferro-$slot-$w-$rep > $R/ferro-$slot-$w-$rep.log 2>&1
    done
    echo "round $rep, $w ranks at $(el) s"; pack
  done
done
echo "done at $(el) s"; pack
