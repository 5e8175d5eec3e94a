cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
D=benchmarks/results/0.4/2core/wire_pieces-2026-11-29
for r in 1 2 3; do for cfg in exact bf16-1m bf16-256k; do
  extra=""; pb=1048576
  [ $cfg != exact ] && extra="--grads-wire bf16"
  [ $cfg = bf16-256k ] && pb=262144
  out=$(PIECEB=$pb timeout 600 ferrorun --emulate-nodes 2 --nproc 1 --link-rate 1gbit $D/max_pieces.py examples/train_lm.py --strategy ddp --bucket-cap-mb 4 --steps 48 --batch-size 2 --seq 64 --eval-every 0 --sample-chars 0 --corpus-chars 400000 --no-progress $extra 2>&1)
  echo "rep $r cap 4 $cfg $(echo "$out" | grep -o '"steps_per_s": [0-9.]*\|"final_loss": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*\|"ddp_buckets": [0-9]*' | awk '{print $2}' | tr '\n' ' ')"
done; done
