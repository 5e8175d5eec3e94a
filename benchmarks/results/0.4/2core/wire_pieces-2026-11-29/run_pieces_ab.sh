cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
for r in 1 2 3; do for p in 1 4; do
  out=$(MAXP=$p timeout 600 ferrorun --emulate-nodes 2 --nproc 1 --link-rate 1gbit benchmarks/results/0.4/2core/wire_pieces-2026-11-29/max_pieces.py examples/train_mlp.py --dataset synthetic --params 8400000 --strategy ddp --optimizer sgd --steps ${STEPS:-30} --comm-hook bf16 --no-progress --no-plot 2>&1)
  echo "rep $r maxp $p $(echo "$out" | grep -o '"steps_per_s": [0-9.]*\|"final_loss": [0-9.]*' | awk '{print $2}' | tr '\n' ' ')"
done; done
