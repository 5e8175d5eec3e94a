# The runs of results.md, from this folder (OPENBLAS_NUM_THREADS=1), modes alternating.
for i in 1 2 3; do
  for n in 3 4; do
    for mode in gathered off; do
      python run.py $n $mode 200 8,4096,16384,65536
    done
  done
done > calls.jsonl
# reduce_scatter (after gathered.reduce_scatter), the calls above with it
for i in 1 2 3; do
  for n in 3 4; do
    for mode in gathered off; do
      python run.py $n $mode 200 4096,16384,65536 rs
    done
  done
done > calls_rs.jsonl
# the metadata round (after metadata_step's use of gathered.exchange); "off" with
# sitecustomize_gathered_off.py copied as sitecustomize.py into $GOFF on PYTHONPATH
for i in 1 2 3; do
  for n in 3 4; do
    python run.py $n gathered 200 4096 meta
    PYTHONPATH=$GOFF GATHERED_OFF=1 python run.py $n off 200 4096 meta
  done
done > calls_meta.jsonl
# reduce and gather (after gathered's rooted forms)
for i in 1 2 3; do
  for n in 3 4; do
    for mode in gathered off; do
      python run.py $n $mode 200 4096,16384 rooted
    done
  done
done > calls_rooted.jsonl
# broadcast (after gathered.broadcast): every rank an array, then the non-roots passing None
for i in 1 2 3; do
  for n in 3 4; do
    for mode in gathered off; do
      python run.py $n $mode 200 4096,16384 broadcast
    done
  done
done > calls_broadcast.jsonl
