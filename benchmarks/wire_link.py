"""The wire formats on a slow link: a float32 mean allreduce exact and with each ``wire=``,
on emulated nodes whose link is shaped (``ferrorun --emulate-nodes``, Linux, root).

    ferrorun --emulate-nodes 2 --nproc 1 --link-rate 1gbit benchmarks/wire_link.py
    ferrorun --emulate-nodes 2 --nproc 2 --link-rate 1gbit benchmarks/wire_link.py --mib 16 64

Every rank calls each format in turn (so each sees the same moments of a shared host),
``--reps`` rounds after one warm-up round; a call's time is the slowest rank's. Rank 0 prints,
per size and format, the median and min-max in ms, the speed-up over exact, and the bytes a
rank's link carries per call in the compressed stage (``ferro_collective.wire.encoded_bytes``)
against exact float32. The link's bound for exact data: an allreduce of S bytes moves at least
``2 (N - 1) / N * S`` bytes through each node's link each way (N nodes).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import ferro_collective as fc
from ferro_backend import init_from_env
from ferro_collective.wire import encoded_bytes

FORMATS = (None, "bf16", "fp16", "int8", "int4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[16])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    b = init_from_env()
    try:
        for mib in args.mib:
            x = np.random.default_rng(b.rank).standard_normal(mib << 18, dtype=np.float32)
            times: dict = {w: [] for w in FORMATS}
            for rnd in range(args.reps + 1):
                for w in FORMATS:
                    fc.barrier(b)
                    t = time.perf_counter()
                    fc.allreduce(x, b, fc.ReduceOp.MEAN, wire=w)
                    took = fc.allreduce(np.array([time.perf_counter() - t]), b, fc.ReduceOp.MAX)
                    if rnd:
                        times[w].append(float(took[0]))
            if b.rank == 0:
                exact = statistics.median(times[None])
                print(f"{mib} MiB float32 mean allreduce, {b.world_size} ranks, {args.reps} "
                      "rounds: median ms (min-max), speed-up over exact, wire bytes per value")
                for w, ts in times.items():
                    med = statistics.median(ts)
                    per_value = 4.0 if w is None else encoded_bytes(x.size, w) / x.size
                    print(f"  {str(w):5s} {med * 1e3:8.1f} ({min(ts) * 1e3:.1f}-"
                          f"{max(ts) * 1e3:.1f})  {exact / med:5.2f}x  {per_value:.2f} B")
    finally:
        b.close()


if __name__ == "__main__":
    main()
