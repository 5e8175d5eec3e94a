import time

import numpy as np

import ferro_collective as fc
from ferro_collective import pair


def bench(backend, iters, mode):
    if mode == "off":
        pair.FUSE_MAX = -1
    out = {}
    for nb in (4096, 65536, 1 << 20):
        x = np.ones(nb // 4, np.float32)
        for name, f in (("broadcast", lambda x=x: fc.broadcast(x, backend, 0)),
                        ("broadcast None", lambda x=x: fc.broadcast(
                            x if backend.rank == 0 else None, backend, 0))):
            for _ in range(20):
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
