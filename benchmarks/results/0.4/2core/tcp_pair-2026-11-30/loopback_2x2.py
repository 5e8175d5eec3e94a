"""`python loopback_2x2.py TAG`: 4 processes of this host as 2 nodes x 2 over loopback TCP
(`attach_hierarchy`, each node's ranks on its engine), 1000 calls of each case after 20, us a
call, the slowest rank's ("off": `sitecustomize_pair_off.py` on `PYTHONPATH`, `PAIR_OFF=1`)."""

import sys
import time

from ferro_backend.testing import run_processes


def fn(b, nodes):
    import numpy as np

    import ferro_collective as fc
    from ferro_backend.hierarchy import attach_hierarchy

    attach_hierarchy(b, nodes)
    res = {}
    for name, f in [("barrier", lambda: fc.barrier(b)),
                    ("ar4k", lambda: fc.allreduce(np.ones(1024, np.float32), b)),
                    ("bc64k", lambda: fc.broadcast(np.ones(16384, np.float32), b, root=0))]:
        for _ in range(20):
            f()
        t = time.perf_counter()
        for _ in range(1000):
            f()
        res[name] = round((time.perf_counter() - t) / 1000 * 1e6)
    return res


if __name__ == "__main__":
    r = run_processes(fn, 4, ("a", "a", "b", "b"), timeout=300)
    print(sys.argv[1], {k: max(x[k] for x in r) for k in r[0]})
