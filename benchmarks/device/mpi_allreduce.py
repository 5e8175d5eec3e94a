"""One MPI launch's allreduce timings (mpi4py, float32 sum): for each size, a barrier, a tenth
as many warm-up calls, then calls timed on every rank; rank 0 prints one JSON line with the
slowest rank's mean per call in us, and what it ran with (``I_MPI_ADJUST_ALLREDUCE``).

    mpiexec -n 16 python mpi_allreduce.py 65536 1048576 16777216
"""

import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
sizes = [int(s) for s in sys.argv[1:]] or [65536, 1 << 20, 16 << 20]
result = {"preset": os.environ.get("I_MPI_ADJUST_ALLREDUCE", "default"), "ranks": comm.size,
          "us": {}}
for nbytes in sizes:
    x = np.ones(nbytes // 4, np.float32)
    out = np.empty_like(x)
    k = max(10, min(1000, (128 << 20) // nbytes))
    for _ in range(max(3, k // 10)):
        comm.Allreduce(x, out)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(k):
        comm.Allreduce(x, out)
    mine = (time.perf_counter() - t0) / k
    result["us"][nbytes] = round(comm.allreduce(mine, op=MPI.MAX) * 1e6, 2)
    result["ok"] = bool(out[0] == comm.size)
if comm.rank == 0:
    print(json.dumps(result), flush=True)
