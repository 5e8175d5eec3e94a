cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
for r in 1 2 3; do
 for cap in 25 4; do for w in exact bf16; do
  extra=""; [ $w = bf16 ] && extra="--grads-wire bf16"
  out=$(timeout 600 ferrorun --emulate-nodes 2 --nproc 1 --link-rate 1gbit examples/train_lm.py --strategy ddp --bucket-cap-mb $cap --steps 48 --batch-size 2 --seq 64 --eval-every 0 --sample-chars 0 --corpus-chars 400000 --no-progress $extra 2>&1)
  echo "rep $r cap $cap $w $(echo "$out" | grep -o '"steps_per_s": [0-9.]*\|"final_loss": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*\|"ddp_buckets": [0-9]*' | awk '{print $2}' | tr '\n' ' ')" >> /tmp/gx/after_ddp.log
 done; done
 for cfg in exact wire wire+sec; do
  extra=""; [ $cfg = wire ] && extra="--weights-wire int8 --grads-wire bf16"
  [ $cfg = wire+sec ] && extra="--weights-wire int8 --grads-wire bf16 --secondary-shard"
  out=$(timeout 900 ferrorun --emulate-nodes 2 --nproc 1 --link-rate 1gbit examples/train_lm.py --steps 48 --batch-size 2 --seq 64 --eval-every 0 --sample-chars 0 --corpus-chars 400000 --no-progress $extra 2>&1)
  echo "rep $r 2x1 B=2 $cfg $(echo "$out" | grep -o '"steps_per_s": [0-9.]*\|"final_loss": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*' | awk '{print $2}' | tr '\n' ' ')" >> /tmp/gx/after_fsdp.log
 done
done
