"""Module-level rank functions for the TCP tests (spawned processes import them)."""

import numpy as np

from ferro_collective import (
    ReduceOp,
    all_gather,
    all_gather_async,
    allreduce,
    allreduce_async,
    barrier,
    broadcast,
    reduce_scatter,
)


def suite(b, seed):
    """Every collective and algorithm on one job; returns byte strings to compare."""
    n, r = b.world_size, b.rank
    rng = np.random.default_rng(seed + r)
    x = rng.standard_normal(1000).astype(np.float32)
    out = {}
    for algo in ("ring", "recursive_doubling", "star"):
        out[f"allreduce-{algo}"] = allreduce(x, b, ReduceOp.SUM, algorithm=algo).tobytes()
    out["mean"] = allreduce(x.astype(np.float64), b, ReduceOp.MEAN).tobytes()
    out["max"] = allreduce(np.array([r, -r], np.int64), b, ReduceOp.MAX).tolist()
    out["gather"] = all_gather(np.full((2, 3), r, np.int32), b).tolist()
    out["rs"] = reduce_scatter(np.arange(4 * n, dtype=np.float64).reshape(2 * n, 2), b).tolist()
    out["bcast"] = broadcast(np.array([r * 7]), b, root=n - 1).tolist()
    w1 = allreduce_async(np.full(3, r, np.float64), b)
    w2 = all_gather_async(np.array(r), b)
    sync = allreduce(np.ones(5), b).tolist()
    out["async"] = [w2.wait(30).tolist(), w1.wait(30).tolist(), sync]
    barrier(b)
    out["inputs"] = x.tobytes()
    return out


def subgroup_gave_up(b, engine=False) -> list:
    """Ranks 0 and 2 of 3 share a subgroup (its own engine with ``engine``); rank 0's
    allreduce on it times out, rank 2 calls late (once rank 0's abort notice has reached it):
    it raises PeerAbortedError naming rank 0 (before: it completed the call with rank 0's
    abandoned data, or waited out its deadline). Then the parent's allreduce runs on every
    rank: only the subgroup ended."""
    import threading
    import time

    from ferro_backend import SubBackend

    out = []
    if b.rank != 1:
        sub = SubBackend(b, [0, 2], name="gave-up")
        if engine:
            from ferro_backend.engine import attach_engine

            attach_engine(sub)
        if b.rank == 2:  # late by construction, not by a sleep a loaded host can outlast: the
            # notice of rank 0's timeout has come (a call before it, with rank 0's data on the
            # way before the notice, may still complete: the notice is what makes it late)
            told = threading.Event()
            b.on_subgroup_abort(sub.group_id, told.set)
            out.append(told.wait(30))
        t0 = time.monotonic()
        try:
            got = allreduce(np.full(2, 100.0 if b.rank == 0 else 2.0), sub,
                            timeout=0.5 if b.rank == 0 else 20)
            out.append(("result", got.tolist()))
        except Exception as exc:
            out.append((type(exc).__name__, str(exc), time.monotonic() - t0 < 10))
    out.append(allreduce(np.ones(2), b, timeout=30).tolist())
    return out
