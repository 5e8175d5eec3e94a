"""`mpirun -n N python mpi.py MODE`: run.py's calls (4 KiB allreduce, all_gather,
reduce_scatter, the barrier) over MpiBackend; MODE "off" exchanges the header first
(`gathered.GATHER_MAX = 0`). Rank 0 prints one JSON line, each cell the slowest rank's."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run

from ferro_backend import MpiBackend
from ferro_collective import all_gather_object

b = MpiBackend(timeout=60)
res = run.bench(b, sys.argv[1], 300, [4096], "rs")
every = all_gather_object(res, b)
if b.rank == 0:
    print(json.dumps({"n": b.world_size, "mode": sys.argv[1],
                      **{k: max(r[k] for r in every) for k in res}}), flush=True)
b.close()
