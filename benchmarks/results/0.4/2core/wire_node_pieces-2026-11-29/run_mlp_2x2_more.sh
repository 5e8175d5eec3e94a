cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
W=benchmarks/results/0.4/2core/wire_pieces-2026-11-29/max_pieces.py
for r in 4 5 6; do
  for cfg in exact bf16-1 bf16-4; do
    h=allreduce; mp=4; [ $cfg != exact ] && { h=bf16; mp=${cfg#bf16-}; }
    out=$(MAXP=$mp timeout 600 ferrorun --emulate-nodes 2 --nproc 2 --link-rate 1gbit $W examples/train_mlp.py --dataset synthetic --params 8400000 --strategy ddp --optimizer sgd --steps 30 --comm-hook $h --no-progress --no-plot 2>&1)
    echo "rep $r 2x2 mlp $cfg $(echo "$out" | grep -o '"steps_per_s": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*' | awk '{print $2}' | tr '\n' ' ')"
  done
done
