#!/bin/bash
# DDP on train_lm's GPT, 2 emulated nodes x 1 rank at 1 Gbit/s (as train_ddp_wire-2026-11-29's
# run_lm.sh), buckets of 4 and 25 MiB with and without a first bucket of 1 MiB, exact and bf16,
# ROUNDS interleaved rounds: steps/s, final loss, bytes a rank sends a step, buckets.
cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
for r in $(seq "${1:-3}"); do for caps in "4" "4 1" "25" "25 1"; do for w in exact bf16; do
  set -- $caps; cap=$1; first=$2
  extra=""; [ $w = bf16 ] && extra="--grads-wire bf16"
  [ -n "$first" ] && extra="$extra --first-bucket-cap-mb $first"
  out=$(timeout 600 ferrorun --emulate-nodes 2 --nproc 1 --link-rate 1gbit examples/train_lm.py --strategy ddp --bucket-cap-mb $cap --steps 48 --batch-size 2 --seq 64 --eval-every 0 --sample-chars 0 --corpus-chars 400000 --no-progress $extra 2>&1)
  echo "rep $r cap $cap first ${first:-same} $w $(echo "$out" | grep -o '"steps_per_s": [0-9.]*\|"final_loss": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*\|"ddp_buckets": [0-9]*' | awk '{print $2}' | tr '\n' ' ')"
done; done; done
