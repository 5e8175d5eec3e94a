"""12 blocking allreduces of N float32 values in place (``out=``), with WIRE ("none": exact);
rank 0 prints the median, min and max of the last 10 in ms, and the job's hierarchy."""

import sys
import time

import numpy as np

import ferro_collective as fc
from ferro_backend import init_from_env
from ferro_collective import ReduceOp

b = init_from_env()
h = getattr(b, "hierarchy", None)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 8_400_000
wire = sys.argv[2] if len(sys.argv) > 2 else "bf16"
wire = None if wire == "none" else wire
if b.rank == 0:
    print("hier", None if h is None else (h.num_nodes, h.local_world), flush=True)
x = np.random.default_rng(b.rank).standard_normal(n).astype(np.float32)
ts = []
for _ in range(12):
    fc.barrier(b)
    t = time.perf_counter()
    fc.allreduce(x, b, ReduceOp.MEAN, out=x, wire=wire)
    ts.append(time.perf_counter() - t)
if b.rank == 0:
    ts = sorted(ts[2:])
    print(wire, n, f"ms med {1e3 * ts[len(ts) // 2]:.1f} min {1e3 * ts[0]:.1f} "
          f"max {1e3 * ts[-1]:.1f}", flush=True)
