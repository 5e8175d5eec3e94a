# train_lm FSDP on 4 emulated nodes x 2 at 1 Gbit/s (issue 54's configuration), as shipped and
# with GATHERED_OFF (sitecustomize_gathered_off.py copied as sitecustomize.py into $GOFF),
# alternating; from the repository's root.
export OPENBLAS_NUM_THREADS=1
for r in 1 2 3; do for cfg in exact wire+sec; do for mode in gathered off; do
  extra=""; [ $cfg = wire+sec ] && extra="--weights-wire int8 --grads-wire bf16 --secondary-shard"
  env=""; [ $mode = off ] && env="PYTHONPATH=$GOFF GATHERED_OFF=1"
  out=$(env $env timeout 900 ferrorun --emulate-nodes 4 --nproc 2 --link-rate 1gbit examples/train_lm.py --steps 48 --batch-size 8 --seq 64 --eval-every 0 --sample-chars 0 --corpus-chars 400000 --no-progress $extra 2>&1)
  echo "rep $r 4x2 $cfg $mode $(echo "$out" | grep -o '"steps_per_s": [0-9.]*\|"final_loss": [0-9.]*\|"bytes_sent_per_rank_per_step": [0-9.]*' | awk '{print $2}' | tr '\n' ' ')"
done; done; done
