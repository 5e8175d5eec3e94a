cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
D=benchmarks/results/0.4/2core/wire_pieces-2026-11-29
for r in 1 2 3; do for p in 1 4; do
  echo "rep $r maxp $p $(MAXP=$p timeout 300 ferrorun --emulate-nodes 2 --nproc 2 --link-rate 1gbit $D/max_pieces.py $D/allreduce_wire.py 8400000 bf16 2>&1 | tail -1)"
done; echo "rep $r exact $(timeout 300 ferrorun --emulate-nodes 2 --nproc 2 --link-rate 1gbit $D/allreduce_wire.py 8400000 none 2>&1 | tail -1)"; done
