"""`python run.py N MODE ITERS SIZES [rs|meta|rooted|broadcast]`: small allreduce, all_gather
(with "rs", reduce_scatter; "meta", the collectives with a metadata round; "rooted", reduce
and gather; "broadcast", broadcasts with arrays, then with None on the non-roots; the last two
each loop ending with a barrier) and barrier of N processes
over TCP (127.0.0.1), printed as one JSON line, each cell the slowest rank's median over 5
loops of ITERS calls (after 20 warm-up calls), us. MODE "gathered": as shipped (a small call of
three ranks or more rides the header exchange's rounds, `ferro_collective.gathered`); "off":
the same code exchanging the header first (`gathered.GATHER_MAX = 0`). SIZES: bytes,
comma-separated. The mode a size ran in is checked from the messages a rank sends."""

import json
import sys
import time

import numpy as np

from ferro_backend.testing import run_processes


def bench(b, mode: str, iters: int, sizes: list[int], extra: str = "") -> dict:
    import ferro_collective as fc
    from ferro_collective import gathered

    if mode == "off":  # (the runs with "meta" add sitecustomize_gathered_off.py's metadata)
        gathered.GATHER_MAX = 0
    sent = [0]
    real = b.send

    def send(data, dst, *, tag=0):
        sent[0] += 1
        return real(data, dst, tag=tag)

    b.send = send
    out = {}
    calls = [("barrier", lambda: fc.barrier(b))]
    for nb in sizes:
        x = np.ones(nb // 4, np.float32)
        calls += [(f"allreduce {nb}", lambda x=x: fc.allreduce(x, b)),
                  (f"all_gather {nb}", lambda x=x: fc.all_gather(x, b))]
        if extra == "rs":  # (an input of NB bytes, rounded down to a multiple of N elements)
            y = np.ones(nb // 4 // b.world_size * b.world_size, np.float32)
            calls.append((f"reduce_scatter {nb}", lambda y=y: fc.reduce_scatter(y, b)))
        if extra == "rooted":  # (reduce and gather, to rank 1; a barrier after each loop)
            calls += [(f"reduce {nb}", lambda x=x: fc.reduce(x, b, 1)),
                      (f"gather {nb}", lambda x=x: fc.gather(x, b, 1))]
        if extra == "broadcast":  # (from rank 1, every rank passing an array, then None)
            calls += [(f"broadcast {nb}", lambda x=x: fc.broadcast(x, b, 1)),
                      (f"broadcast None {nb}",
                       lambda x=x: fc.broadcast(x if b.rank == 1 else None, b, 1))]
        if extra == "meta":  # (the collectives with a metadata round)
            y = np.ones(nb // 4 // b.world_size * b.world_size, np.float32)
            calls += [(f"all_to_all_single {nb}", lambda y=y: fc.all_to_all_single(y, b)),
                      (f"all_gather_v {nb}", lambda y=y: fc.all_gather_v(y[:y.size // 2], b)),
                      (f"all_gather_object {nb}",
                       lambda nb=nb: fc.all_gather_object({"a": nb}, b))]
    for label, f in calls:
        sent[0] = 0
        f()
        out[f"sends {label}"] = sent[0]
        for _ in range(20):
            f()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(iters):
                f()
            if extra in ("rooted", "broadcast"):  # (a non-root would otherwise run ahead)
                fc.barrier(b)
            ts.append((time.perf_counter() - t) / iters * 1e6)
        out[label] = round(sorted(ts)[2], 1)
    return out


if __name__ == "__main__":
    n, mode, iters = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    sizes = [int(x) for x in sys.argv[4].split(",")]
    res = run_processes(bench, n, mode, iters, sizes, sys.argv[5] if len(sys.argv) > 5 else "",
                        timeout=1800)
    print(json.dumps({"n": n, "mode": mode, **{k: max(r[k] for r in res) for k in res[0]}}),
          flush=True)
