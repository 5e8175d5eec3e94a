cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
for cfg in exact wire wire+sec; do
  extra=""; [ $cfg = wire ] && extra="--weights-wire int8 --grads-wire bf16"
  [ $cfg = wire+sec ] && extra="--weights-wire int8 --grads-wire bf16 --secondary-shard"
  out=$(timeout 900 ferrorun --emulate-nodes 4 --nproc 2 --link-rate 1gbit examples/train_lm.py --steps 60 --eval-every 60 --eval-batches 8 --batch-size 8 --seq 64 --sample-chars 0 --corpus-chars 400000 --no-progress $extra 2>&1)
  echo "held 4x2 B=8 60 steps $cfg $(echo "$out" | grep -o '"held_out_loss": [0-9.]*\|"steps_per_s": [0-9.]*\|"final_loss": [0-9.]*' | awk '{print $2}' | tr '\n' ' ')"
done
