cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
for r in 4 5 6; do for shape in "4 2 8" "2 2 4"; do set -- $shape; nodes=$1; nproc=$2; B=$3
 for cfg in exact wire wire+sec; do
  extra=""; [ $cfg = wire ] && extra="--weights-wire int8 --grads-wire bf16"
  [ $cfg = wire+sec ] && extra="--weights-wire int8 --grads-wire bf16 --secondary-shard"
  out=$(timeout 900 ferrorun --emulate-nodes $nodes --nproc $nproc --link-rate 1gbit examples/train_lm.py --steps 48 --batch-size $B --seq 64 --eval-every 0 --sample-chars 0 --corpus-chars 400000 --no-progress $extra 2>&1)
  echo "rep $r ${nodes}x${nproc} B=$B $cfg $(echo "$out" | grep -o '"steps_per_s": [0-9.]*\|"final_loss": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*' | awk '{print $2}' | tr '\n' ' ')"
done; done; done
