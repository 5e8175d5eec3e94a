# The runs of results.md, from this folder (OPENBLAS_NUM_THREADS=1), modes alternating.
for i in 1 2 3; do
  for mode in pair off; do
    python run.py symmetric $mode 300 4096,65536,262144,1048576
    python run.py metadata $mode 300 4096,65536
    python run.py rooted $mode 300 4096,65536
    python run.py broadcast $mode 200 4096,65536,1048576
  done
done > calls.jsonl
for i in 1 2; do
  for mode in big off; do
    python run.py symmetric $mode 100 524288,1048576,4194304
  done
done > calls_large.jsonl
