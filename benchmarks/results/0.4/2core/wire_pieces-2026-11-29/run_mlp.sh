cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
for r in 1 2 3; do for h in allreduce bf16; do
  out=$(timeout 600 ferrorun --emulate-nodes 2 --nproc 1 --link-rate 1gbit examples/train_mlp.py --dataset synthetic --params 8400000 --strategy ddp --optimizer sgd --steps 30 --comm-hook $h --no-progress --no-plot 2>&1)
  echo "rep $r $h $(echo "$out" | grep -o '"steps_per_s": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*\|"final_loss": [0-9.]*' | awk '{print $2}' | tr '\n' ' ')"
done; done
