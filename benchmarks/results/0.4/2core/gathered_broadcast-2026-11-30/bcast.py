"""`python bmsg.py N MODE ITERS SIZES`: allreduce, all_gather (block NB/N), reduce_scatter and
broadcast of NB bytes on N processes over TCP (127.0.0.1), one JSON line, each cell the slowest
rank's median over 5 loops of ITERS calls (after 20 warm-up calls), us ("cpu ...": the CPU
time of every rank's process, threads included, per call, summed over the ranks). MODE "shipped": as the
tree ships; "gathered": every call up to GATHER_MAX gathered in the header exchange's rounds
(costmodel.gathers forced True); "off": every call exchanges its header first (GATHER_MAX 0).
The form each cell ran in is told by the messages a rank sends ("sends ...")."""

import json
import sys
import time

import numpy as np

from ferro_backend.testing import run_processes


def bench(b, mode: str, iters: int, sizes: list[int]) -> dict:
    import ferro_collective as fc
    from ferro_collective import costmodel, gathered

    if mode == "off":
        gathered.GATHER_MAX = 0
    elif mode == "gathered":
        costmodel.gathers = lambda name, nb, n, p=None: 0 < n * nb <= gathered.GATHER_MAX
    sent = [0]
    real = b.send

    def send(data, dst, *, tag=0):
        sent[0] += 1
        return real(data, dst, tag=tag)

    b.send = send
    n = b.world_size
    out = {}
    calls = []
    for nb in sizes:
        x = np.ones(nb // 4 // n * n, np.float32)
        calls += [(f"broadcast {nb}", lambda x=x: fc.broadcast(x, b, 0), True)]
    for label, f, fenced in calls:
        sent[0] = 0
        f()
        out[f"sends {label}"] = sent[0]
        for _ in range(20):
            f()
        ts, cs = [], []
        for _ in range(5):
            t, c = time.perf_counter(), time.process_time()
            for _ in range(iters):
                f()
            if fenced:
                fc.barrier(b)
            ts.append((time.perf_counter() - t) / iters * 1e6)
            cs.append((time.process_time() - c) / iters * 1e6)
        out[label] = round(sorted(ts)[2], 1)
        out[f"cpu {label}"] = round(sorted(cs)[2], 1)
    return out


if __name__ == "__main__":
    n, mode, iters = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    sizes = [int(x) for x in sys.argv[4].split(",")]
    res = run_processes(bench, n, mode, iters, sizes, timeout=1800)
    print(json.dumps({"n": n, "mode": mode, **{  # (CPU: the ranks' sum; time: the slowest's)
        k: round(sum(r[k] for r in res), 1) if k.startswith("cpu") else max(r[k] for r in res)
        for k in res[0]}}), flush=True)
