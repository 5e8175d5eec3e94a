#!/bin/bash
# calls_per_run.py under glibc's defaults and with its heap kept (3 launches each, alternating)
cd "$(dirname "$0")"
for i in 1 2 3; do
  echo "# default, launch $i"
  ferrorun --nproc 2 calls_per_run.py 2>&1 | grep "rank 0" | sed 's/^\[rank 0\] //'
  echo "# GLIBC_TUNABLES, launch $i"
  GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295 \
    ferrorun --nproc 2 calls_per_run.py 2>&1 | grep "rank 0" | sed 's/^\[rank 0\] //'
done
