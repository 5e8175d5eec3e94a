#!/bin/bash
# Issue 55, second call: the 8- and 16-rank allreduce, one-call split against two phases
# (FERRO_SHM_TWO_PHASE_BYTES) and 4 MiB slots, interleaved, with Intel MPI in the same run.
set -u
P=$PWD/.devpay; R=/tmp/res; rm -rf $R; mkdir -p $R
export PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-220}
el() { echo $(( $(date +%s) - T0 )); }
pack() { tar czf $OUT/res.tgz -C $R . 2>/dev/null; }
PY=${PY:-python3}
if [ -z "${NOSETUP:-}" ]; then
  SITE=$($PY -c "import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))")
  for v in fv impi; do $PY -m venv /tmp/$v && echo $SITE > $(/tmp/$v/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_host.pth; done
  /tmp/fv/bin/pip install -q --no-index --no-deps $P/whl/*.whl
  /tmp/impi/bin/pip install -q --no-index --no-deps $P/whl/mpi4py-*.whl && tar xJf $P/impi_trim.tar.xz -C /tmp/impi
fi
F=/tmp/fv/bin/python
SIZES="--sizes 65536 1048576 16777216 67108864"
echo "setup at $(el) s"
for rep in 1 2 3; do
  for w in 8 16; do
    cpus=0-$(( w - 1 ))
    for v in split two_phase slot4m slot4m_two_phase impi; do
      [ $(el) -gt $BUDGET ] && { echo "budget reached at $(el) s"; pack; exit 0; }
      env=""; impl=ferro-shm
      case $v in two_phase) env="FERRO_SHM_TWO_PHASE_BYTES=64k";; slot4m) env="FERRO_SHM_SLOT_BYTES=4m";;
        slot4m_two_phase) env="FERRO_SHM_SLOT_BYTES=4m FERRO_SHM_TWO_PHASE_BYTES=64k";; impi) impl=impi;; esac
      env $env I_MPI_PIN_PROCESSOR_LIST=$cpus timeout 60 taskset -c $cpus $F benchmarks/peers.py --worlds $w --impls $impl \
        --impi-venv /tmp/impi --ops allreduce $SIZES --repeat 1 --no-host-probe --timeout 50 \
        --out $R/$v-$w-$rep > $R/$v-$w-$rep.log 2>&1 || echo "$v $w $rep failed"
      rm -f $R/$v-$w-$rep/busbw.png $R/$v-$w-$rep/results.md
    done
    echo "rep $rep world $w at $(el) s"; pack
  done
done
echo "done at $(el) s"; pack
