#!/bin/bash
# The allreduce at 8 and 16 ranks on a lent machine (issue 55), second study: the split's
# choices one at a time, interleaved with Intel MPI in the same rounds (3 rounds), then Intel
# MPI's allreduce presets (which algorithm its default matches) with the budget left.
# Variants (VARIANTS): the engine as it is (split); non-temporal stores for the split's copies
# into shared memory (stream: FERRO_STUDY_STREAM=1); 4 MiB slots (16-rank chunks of 64 KiB);
# 4 MiB slots with the split's rings capped at 64 KiB a sub-ring (FERRO_STUDY_RING); ring
# alone; combinations; new4m / new2m: 4 / 2 MiB slots with the rings of a 1 MiB slot; impi.
# OPS (allreduce). ROUNDS rounds (3) at WORLDS (8 16); PRESETS=0 skips the presets.
# The FERRO_STUDY_* knobs are in results/0.4/h200-16core/split-study-2026-11-30/study.patch (not
# merged): `git apply` it, then prepare.sh, then in the call:
# `OUT=$OUT BUDGET=380 bash .devpay/study_split.sh`; results: $OUT/split.tgz.
NAME=split; DEFAULT_BUDGET=380
. "$(dirname "$0")/call.sh"
{ grep -m1 "model name" /proc/cpuinfo; grep -o -m1 -w cldemote /proc/cpuinfo || echo "no cldemote";
  nproc; } > $R/cpu.txt 2>&1
bash $P/venvs.sh $PY
F=/tmp/fv/bin/python
SIZES="--sizes 65536 1048576 16777216 67108864"
echo "setup at $(el) s"
for rep in $(seq 1 ${ROUNDS:-3}); do
  for w in ${WORLDS:-8 16}; do
    cpus=0-$(( w - 1 ))
    for v in ${VARIANTS:-split stream slot4m slot4m_ring slot4m_stream ring impi}; do
      [ $(el) -gt $BUDGET ] && { echo "budget reached at $(el) s"; pack; exit 0; }
      env=""; impl=ferro-shm
      case $v in stream) env="FERRO_STUDY_STREAM=1";; ring) env="FERRO_STUDY_RING=64k";;
        slot4m) env="FERRO_SHM_SLOT_BYTES=4m";;
        slot4m_ring) env="FERRO_SHM_SLOT_BYTES=4m FERRO_STUDY_RING=64k";;
        slot4m_stream) env="FERRO_SHM_SLOT_BYTES=4m FERRO_STUDY_STREAM=1";;
        new4m) env="FERRO_SHM_SLOT_BYTES=4m FERRO_STUDY_RING=$(( 1024 / w ))k";;
        new2m) env="FERRO_SHM_SLOT_BYTES=2m FERRO_STUDY_RING=$(( 1024 / w ))k";;
        impi) impl=impi;; esac
      env $env I_MPI_PIN_PROCESSOR_LIST=$cpus timeout 60 taskset -c $cpus $F benchmarks/peers.py --worlds $w --impls $impl \
        --impi-venv /tmp/impi --ops ${OPS:-allreduce} $SIZES --repeat 1 --no-host-probe --timeout 50 \
        --out $R/$v-$w-$rep > $R/$v-$w-$rep.log 2>&1 || echo "$v $w $rep failed"
      rm -f $R/$v-$w-$rep/busbw.png $R/$v-$w-$rep/results.md
    done
    echo "rep $rep world $w at $(el) s"; pack
  done
done
[ "${PRESETS:-1}" = 0 ] && { echo "done at $(el) s"; pack; exit 0; }
for w in 16 8; do
  cpus=0-$(( w - 1 ))
  for preset in default $(seq 1 24); do
    [ $(( $(el) + 8 )) -gt $BUDGET ] && { echo "budget reached at $(el) s"; pack; exit 0; }
    env=""; [ $preset != default ] && env="I_MPI_ADJUST_ALLREDUCE=$preset"
    env $env I_MPI_FABRICS=shm I_MPI_PIN_PROCESSOR_LIST=$cpus timeout 20 taskset -c $cpus \
      /tmp/impi/bin/mpiexec -n $w /tmp/impi/bin/python $P/mpi_allreduce.py 65536 1048576 16777216 \
      >> $R/impi_presets.jsonl 2>> $R/impi_presets.err \
      || echo "{\"preset\": \"$preset\", \"ranks\": $w, \"failed\": true}" >> $R/impi_presets.jsonl
  done
  echo "presets at $w ranks at $(el) s"; pack
done
echo "done at $(el) s"; pack
