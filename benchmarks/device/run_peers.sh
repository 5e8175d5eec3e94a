#!/bin/bash
# Issue 55 on a lent 16-core machine, as one call of the `device` tool (prepare.sh first, then
# `OUT=$OUT BUDGET=470 bash .devpay/run_peers.sh` with .devpay carried): the machine's topology
# and every pair of cores' round trip (core_pairs), what the MPIs report of their pinning, then
# peers.py (ferro-shm, Open MPI default and coll/sm, Intel MPI shm) at 8 ranks on cores 0-7,
# 16, and 2 on the nearest and the farthest pair of cores, plain and fresh; each step is
# skipped if it would pass BUDGET seconds; everything comes back as $OUT/res.tgz.
# env: OUT, BUDGET, PY (the Python to use), NOSETUP=1 (the venvs exist), SMOKE=1 (a short check).
NAME=res; DEFAULT_BUDGET=480
. "$(dirname "$0")/call.sh"
{ date; uname -a; nproc; lscpu; grep -m1 "model name" /proc/cpuinfo
  for c in /sys/devices/system/cpu/cpu*/cache/index*/; do
    echo "$c L$(cat $c/level) $(cat $c/type) $(cat $c/size) shared=$(cat $c/shared_cpu_list)"; done
  ls /sys/devices/system/node/; cat /sys/devices/system/cpu/cpu0/topology/*_list
  free -g; $PY --version; cat /sys/kernel/mm/transparent_hugepage/enabled; } > $R/topo.txt 2>&1
$P/core_pairs > $R/core_pairs.txt 2>&1; $P/core_pairs > $R/core_pairs2.txt 2>&1
eval "$($PY $P/placement.py $R/core_pairs.txt | tee $R/placement.txt)"
pack; echo "topology at $(el) s: $(cat $R/placement.txt)"
[ -n "${NOSETUP:-}" ] || bash $P/venvs.sh $PY
/tmp/fv/bin/python -c "import numpy, mpi4py, ferro_backend; print(numpy.__version__, mpi4py.__file__, ferro_backend.__file__)" > $R/venv_check.txt 2>&1
F=/tmp/fv/bin/python
cat > /tmp/hello.py <<'PY'
from mpi4py import MPI
import numpy as np
c = MPI.COMM_WORLD; a = np.ones(1 << 16, np.float32); b = np.empty_like(a); c.Allreduce(a, b)
print(c.rank, c.size, b[0], MPI.Get_library_version().split("\n")[0][:60], flush=True)
PY
IMPLS="ferro-shm"
timeout 40 /tmp/fv/bin/mpirun -n 2 --oversubscribe $F /tmp/hello.py > $R/hello_ompi.txt 2>&1 && IMPLS="$IMPLS mpi mpi-sm"
I_MPI_FABRICS=shm timeout 40 /tmp/impi/bin/mpiexec -n 2 /tmp/impi/bin/python /tmp/hello.py > $R/hello_impi.txt 2>&1 && IMPLS="$IMPLS impi"
timeout 20 $F -c "import ferro_backend, ferro_collective; print(ferro_backend.__file__)" > $R/hello_ferro.txt 2>&1
echo "impls: $IMPLS at $(el) s"; pack
(while :; do echo "t=$(el)"; ps -eLo psr,pid,comm | grep -i python | sort -n | awk '{print $1}' | uniq -c | tr '\n' ' '; echo; sleep 4; done) > $R/psr.log 2>&1 &
SAMPLER=$!
OPS="allreduce all_gather reduce_scatter broadcast barrier"
SIZES=""; REP=3
[ -n "${SMOKE:-}" ] && { OPS="allreduce barrier"; SIZES="--sizes 4096 65536"; REP=1; }
step() {  # name, estimate (s), cpus, world, extra args
  local name=$1 est=$2 cpus=$3 world=$4; shift 4
  if [ $(( $(el) + est )) -gt $BUDGET ]; then echo "skip $name at $(el) s"; echo "$name skipped at $(el)" >> $R/skipped.txt; return; fi
  echo "== $name on cpus $cpus at $(el) s"; local t=$(date +%s)
  I_MPI_PIN_PROCESSOR_LIST=$cpus timeout $(( BUDGET - $(el) + 5 )) taskset -c $cpus $F benchmarks/peers.py --worlds $world \
    --impls $IMPLS --impi-venv /tmp/impi --ops $OPS $SIZES --repeat $REP --no-host-probe \
    --timeout 90 --out $R/$name "$@" > $R/$name.log 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t )) s"; pack
}
# what the MPIs report: their pinning (and Intel MPI's tuning file) under the 8-core placement
I_MPI_DEBUG=6 I_MPI_FABRICS=shm I_MPI_PIN_PROCESSOR_LIST=0-7 timeout 40 taskset -c 0-7 /tmp/impi/bin/mpiexec -n 8 /tmp/impi/bin/python /tmp/hello.py > $R/debug_impi8.txt 2>&1
timeout 40 taskset -c 0-7 /tmp/fv/bin/mpirun -n 8 --oversubscribe --report-bindings $F /tmp/hello.py > $R/debug_ompi8.txt 2>&1
I_MPI_DEBUG=6 I_MPI_FABRICS=shm I_MPI_PIN_PROCESSOR_LIST=$FAR timeout 40 taskset -c $FAR /tmp/impi/bin/mpiexec -n 2 /tmp/impi/bin/python /tmp/hello.py > $R/debug_impi2.txt 2>&1
pack
step p8 90 0-7 8
step p16 130 $(taskset -pc $$ | awk -F': ' '{print $2}') 16
step p2near 50 $NEAR 2
[ "$DISTINCT" = 1 ] && step p2far 50 $FAR 2
[ "$DISTINCT" = 1 ] && step p2far_fresh 50 $FAR 2 --fresh
step p2near_fresh 50 $NEAR 2 --fresh
kill $SAMPLER 2>/dev/null
$P/core_pairs > $R/core_pairs_end.txt 2>&1
echo "done at $(el) s"; pack
