cd /work/main; source /work/venv/bin/activate; export OPENBLAS_NUM_THREADS=1
for r in 1 2; do for h in allreduce bf16; do
  out=$(timeout 600 ferrorun --emulate-nodes 2 --nproc 2 --link-rate 1gbit examples/train_mlp.py --dataset synthetic --params 8400000 --strategy ddp --optimizer sgd --steps 30 --comm-hook $h --no-progress --no-plot 2>&1)
  echo "rep $r 2x2 mlp $h $(echo "$out" | grep -o '"steps_per_s": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*' | awk '{print $2}' | tr '\n' ' ')"
done
for w in exact bf16; do extra=""; [ $w = bf16 ] && extra="--grads-wire bf16"
  out=$(timeout 600 ferrorun --emulate-nodes 2 --nproc 2 --link-rate 1gbit examples/train_lm.py --strategy ddp --bucket-cap-mb 4 --steps 48 --batch-size 4 --seq 64 --eval-every 0 --sample-chars 0 --corpus-chars 400000 --no-progress $extra 2>&1)
  echo "rep $r 2x2 gpt $w $(echo "$out" | grep -o '"steps_per_s": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*' | awk '{print $2}' | tr '\n' ' ')"
done; done
