"""`python calls.py N MODE ITERS SIZES KINDS`: calls of NB bytes (SIZES, comma-separated) on N
processes over TCP (127.0.0.1), one JSON line, each cell the slowest rank's median over 5 loops
of ITERS calls (after 20 warm-up calls), us ("cpu ...": the CPU time of every rank's process,
threads included, per call, summed over the ranks; "sends ...": the messages a rank sends in
the cell's first call, which tells the form it ran in). KINDS, comma-separated, in the order
run for each size: allreduce, all_gather (a block of NB/N), reduce_scatter, broadcast, gather
(a block of NB/N), reduce; the rooted ones (root 0) end each loop with a barrier. MODE
"shipped": as the tree ships; "gathered": every call up to GATHER_MAX gathered in the header
exchange's rounds (`costmodel.gathers` forced true); "off": every call exchanges its header
first (`GATHER_MAX` 0).

The three sets of `results.md` ran this script's calls as three copies, each with its kinds
built in: `ab.sh` (broadcast,gather,reduce), `ab2.sh` (broadcast) and the model's forms
(allreduce,all_gather,reduce_scatter,broadcast); the model's forms recorded no CPU."""

import json
import sys
import time

import numpy as np

from ferro_backend.testing import run_processes

ROOTED = ("broadcast", "gather", "reduce")


def calls(b, sizes: list[int], kinds: list[str]) -> list:
    """``(label, call, ends its loops with a barrier)`` for every size and kind."""
    import ferro_collective as fc

    n, out = b.world_size, []
    for nb in sizes:
        x = np.ones(nb // 4 // n * n, np.float32)
        blk = np.ones(nb // 4 // n, np.float32)
        make = {"allreduce": lambda x=x: fc.allreduce(x, b),
                "all_gather": lambda blk=blk: fc.all_gather(blk, b),
                "reduce_scatter": lambda x=x: fc.reduce_scatter(x, b),
                "broadcast": lambda x=x: fc.broadcast(x, b, 0),
                "gather": lambda blk=blk: fc.gather(blk, b, 0),
                "reduce": lambda x=x: fc.reduce(x, b, 0)}
        out += [(f"{kind} {nb}", make[kind], kind in ROOTED) for kind in kinds]
    return out


def bench(b, mode: str, iters: int, sizes: list[int], kinds: list[str]) -> dict:
    import ferro_collective as fc
    from ferro_collective import costmodel, gathered

    if mode == "off":
        gathered.GATHER_MAX = 0
    elif mode == "gathered":
        bound = getattr(gathered, "gathered_bytes", lambda name, nb, n: n * nb)  # (before 2f384bb)
        costmodel.gathers = lambda name, nb, n, p=None: 0 < bound(name, nb, n) <= gathered.GATHER_MAX
    sent, real = [0], b.send

    def send(data, dst, *, tag=0):
        sent[0] += 1
        return real(data, dst, tag=tag)

    b.send = send
    out = {}
    for label, f, fenced in calls(b, sizes, kinds):
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
    res = run_processes(bench, n, mode, iters, sizes, sys.argv[5].split(","), timeout=1800)
    print(json.dumps({"n": n, "mode": mode, **{  # (CPU: the ranks' sum; time: the slowest's)
        k: round(sum(r[k] for r in res), 1) if k.startswith("cpu") else max(r[k] for r in res)
        for k in res[0]}}), flush=True)
