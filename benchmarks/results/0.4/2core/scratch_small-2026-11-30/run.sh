# From this folder (OPENBLAS_NUM_THREADS=1): the pool's cost, then 2 processes over TCP with
# arrays under 64 KiB fresh (as shipped) and pooled ("pool_all": sitecustomize_pool_all.py
# copied as sitecustomize.py into $POOLALL, with POOL_ALL=1), alternating.
python pool_micro.py > pool_micro.txt
for i in 1 2 3 4; do
  python ../tcp_pair-2026-11-30/run.py symmetric pair 300 4096,65536
  PYTHONPATH=$POOLALL POOL_ALL=1 python ../tcp_pair-2026-11-30/run.py symmetric pair 300 4096,65536 | sed 's/"mode": "pair"/"mode": "pool_all"/'
done > calls.jsonl
