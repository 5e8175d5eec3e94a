import time

import numpy as np

import ferro_collective as fc
from ferro_collective import pair


def bench(backend, sizes, iters, mode):
    if mode == "off":
        pair.FUSE_MAX = -1
    if mode == "big":
        pair.FUSE_MAX = 8 << 20
    out = {}
    for name in ("allreduce", "all_gather", "reduce_scatter", "barrier"):
        for nb in sizes:
            if name == "barrier" and nb != sizes[0]:
                continue
            n = nb // 4
            x = np.ones(n, np.float32)
            if name == "allreduce":
                f = lambda x=x: fc.allreduce(x, backend)
            elif name == "all_gather":
                f = lambda x=x: fc.all_gather(x, backend)
            elif name == "reduce_scatter":
                f = lambda x=x: fc.reduce_scatter(x, backend)
            else:
                f = lambda: fc.barrier(backend)
            for _ in range(50):
                f()
            best = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(iters):
                    f()
                best.append((time.perf_counter() - t) / iters * 1e6)
            best.sort()
            out[f"{name} {nb}" if name != "barrier" else name] = round(best[2], 1)
    return out
