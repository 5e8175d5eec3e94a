cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
for cfg in "" "--grads-wire powersgd --powersgd-rank 4 --powersgd-start 30"; do
  out=$(timeout 1200 ferrorun --nproc 2 examples/train_lm.py --strategy ddp --steps 600 --eval-every 0 --eval-batches 16 --sample-chars 0 --no-progress --seed 0 $cfg 2>&1)
  echo "cfg [$cfg] $(echo "$out" | grep -o '"held_out_loss": [0-9.]*\|"steps_per_s": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*' | tr '\n' ' ')"
done
