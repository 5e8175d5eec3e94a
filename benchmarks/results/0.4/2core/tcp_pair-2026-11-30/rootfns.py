import time

import numpy as np

import ferro_collective as fc
from ferro_collective import pair


def bench(backend, iters, mode):
    if mode == "off":
        pair.FUSE_MAX = -1
    out = {}
    for name in ("gather", "reduce"):
        for nb in (4096, 65536):
            x = np.ones(nb // 4, np.float32)
            f = {"gather": lambda x=x: fc.gather(x, backend, 0),
                 "reduce": lambda x=x: fc.reduce(x, backend, 0)}[name]
            for _ in range(50):
                f()
            ts = []
            for _ in range(5):
                fc.barrier(backend)
                t = time.perf_counter()
                for _ in range(iters):
                    f()
                fc.barrier(backend)
                ts.append((time.perf_counter() - t) / iters * 1e6)
            out[f"{name} {nb}"] = round(sorted(ts)[2], 1)
    return out
