# DDP over emulated nodes x 2 ranks at 1 Gbit/s: exact, bf16 in one piece (MAXP=1), bf16 in
# pieces, interleaved per round. Usage: bash run_ddp.sh NODES "ROUNDS" "MODELS"; the runs here:
#   bash run_ddp.sh 2 "1 2 3" "mlp gpt" > runs_ddp_2x2.txt
#   bash run_ddp.sh 4 "1 2" mlp         > runs_ddp_4x2.txt
#   bash run_ddp.sh 2 "4 5 6" mlp       > runs_mlp_2x2_more.txt
cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
W=benchmarks/results/0.4/2core/wire_pieces-2026-11-29/max_pieces.py
nodes=$1
for r in $2; do for model in $3; do for cfg in exact bf16-1 bf16-4; do
  mp=4; [ $cfg != exact ] && mp=${cfg#bf16-}
  if [ $model = mlp ]; then
    h=allreduce; [ $cfg != exact ] && h=bf16
    args="examples/train_mlp.py --dataset synthetic --params 8400000 --strategy ddp --optimizer sgd --steps 30 --comm-hook $h --no-progress --no-plot"
  else
    extra=""; [ $cfg != exact ] && extra="--grads-wire bf16"
    args="examples/train_lm.py --strategy ddp --bucket-cap-mb 4 --steps 48 --batch-size 4 --seq 64 --eval-every 0 --sample-chars 0 --corpus-chars 400000 --no-progress $extra"
  fi
  # shellcheck disable=SC2086
  out=$(MAXP=$mp timeout 600 ferrorun --emulate-nodes "$nodes" --nproc 2 --link-rate 1gbit $W $args 2>&1)
  echo "rep $r ${nodes}x2 $model $cfg $(echo "$out" | grep -o '"steps_per_s": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*' | awk '{print $2}' | tr '\n' ' ')"
done; done; done
