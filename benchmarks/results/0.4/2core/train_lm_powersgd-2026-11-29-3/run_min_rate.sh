cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
D=benchmarks/results/0.4/2core/train_lm_powersgd-2026-11-29-3
for cfg in "25 30" "40 30" "25 60" "16 30"; do set -- $cfg
  out=$(MINRATE=$1 timeout 1200 ferrorun --nproc 2 $D/min_rate.py examples/train_lm.py --strategy ddp --steps 300 --eval-every 0 --eval-batches 16 --sample-chars 0 --no-progress --seed 0 --grads-wire powersgd --powersgd-rank 4 --powersgd-start $2 2>&1)
  echo "minrate $1 start $2 $(echo "$out" | grep -o '"held_out_loss": [0-9.]*\|"steps_per_s": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*' | tr '\n' ' ')"
done
