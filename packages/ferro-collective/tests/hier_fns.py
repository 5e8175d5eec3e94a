"""Rank functions for the hierarchical tests (spawned processes import them): TcpBackend jobs
on two "nodes" of this machine, each node with its own engine segment."""

import numpy as np

from ferro_backend import DistributedError
from ferro_backend.hierarchy import attach_hierarchy
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

SIZES = (0, 1, 7, 1000, 300_001, 1_200_001)  # the last: a pipelined hierarchy (3 pieces)


def suite(b, nodes):
    h = attach_hierarchy(b, nodes)
    assert h is not None and b.hierarchy is h
    n, r = b.world_size, b.rank
    out = {"node": list(h.node._global), "cross": list(h.cross._global),
           "describe": b.describe()}
    for size in SIZES:
        x = np.random.default_rng(100 + r).standard_normal(size)
        out[f"sum{size}"] = allreduce(x, b).tobytes()
        out[f"mean{size}"] = allreduce(x.astype(np.float32), b, ReduceOp.MEAN).tobytes()
    # the pipelined stages read the input and write straight into out=, in place or apart,
    # or into a new array; the input is never written
    x = np.random.default_rng(100 + r).standard_normal(SIZES[-1])
    keep = x.copy()
    into = np.empty_like(x)
    allreduce(x, b, out=into)
    fresh = allreduce(x, b)
    same = x.copy()
    allreduce(same, b, out=same)
    out["out="] = [into.tobytes(), fresh.tobytes(), same.tobytes(), x.tobytes() == keep.tobytes()]
    out["int"] = allreduce(np.arange(10, dtype=np.int64) * (r + 1), b).tolist()
    out["max"] = allreduce(np.array([r, -r], np.int32), b, ReduceOp.MAX).tolist()
    out["half"] = allreduce(np.full(5, 0.1 * (r + 1), np.float16), b).tobytes()
    inplace = np.full((3, 2), float(r))
    allreduce(inplace, b, out=inplace)
    out["inplace"] = inplace.tolist()
    out["bcast"] = [broadcast(np.array([10 * r, r]), b, root=k).tolist() for k in range(n)]
    big = np.full(200_000, float(r))
    out["bcast_big"] = float(broadcast(big, b, root=n - 1).sum())
    out["gather"] = all_gather(np.full((2, 3), r, np.int32), b).tolist()
    out["gather0d"] = all_gather(np.array(r), b).tolist()
    out["rs"] = reduce_scatter(np.arange(4 * n, dtype=np.int64).reshape(2 * n, 2), b).tolist()
    w1 = allreduce_async(np.full(3, r, np.float64), b)
    w2 = all_gather_async(np.array([r]), b)
    sync = allreduce(np.ones(5), b).tolist()
    out["async"] = [w2.wait(30).tolist(), w1.wait(30).tolist(), sync]
    barrier(b)
    return out


#: disagreeing calls: (name, rank 0's call, node 0's other ranks', node 1's); each takes
#: (x, b, timeout) (1_200_001 values: 3 pipelined pieces, so more numbers on each group)
DISAGREEMENTS = {
    "collective": (lambda x, b, t: allreduce(np.ones(4), b, timeout=t),
                   lambda x, b, t: broadcast(np.ones(4), b, root=0, timeout=t),
                   lambda x, b, t: broadcast(np.ones(4), b, root=0, timeout=t)),
    "size": (lambda x, b, t: allreduce(np.ones(600, np.float32), b, timeout=t),
             lambda x, b, t: allreduce(np.ones(601, np.float32), b, timeout=t),
             lambda x, b, t: allreduce(np.ones(601, np.float32), b, timeout=t)),
    "between nodes": (lambda x, b, t: allreduce(np.ones(600), b, timeout=t),
                      lambda x, b, t: allreduce(np.ones(600), b, timeout=t),
                      lambda x, b, t: allreduce(np.ones(600, np.float32), b, timeout=t)),
    "pieces": (lambda x, b, t: allreduce(np.ones(1000), b, timeout=t),
               lambda x, b, t: allreduce(np.ones(1_200_001), b, timeout=t),
               lambda x, b, t: allreduce(np.ones(1_200_001), b, timeout=t)),
    "pieces between nodes": (lambda x, b, t: allreduce(np.ones(1_200_001), b, timeout=t),
                             lambda x, b, t: allreduce(np.ones(1_200_001), b, timeout=t),
                             lambda x, b, t: allreduce(np.ones(10), b, timeout=t)),
    "gather and barrier": (lambda x, b, t: all_gather(np.ones(3), b, timeout=t),
                           lambda x, b, t: barrier(b, timeout=t),
                           lambda x, b, t: barrier(b, timeout=t)),
    "root": (lambda x, b, t: broadcast(np.ones(5), b, root=0, timeout=t),
             lambda x, b, t: broadcast(np.ones(5), b, root=3, timeout=t),
             lambda x, b, t: broadcast(np.ones(5), b, root=3, timeout=t)),
    "compressed": (lambda x, b, t: allreduce(np.ones(600, np.float32), b, timeout=t,
                                             wire="bf16"),
                   lambda x, b, t: allreduce(np.ones(600, np.float32), b, timeout=t),
                   lambda x, b, t: allreduce(np.ones(600, np.float32), b, timeout=t)),
    "compressed node": (lambda x, b, t: allreduce(np.ones(600, np.float32), b, timeout=t,
                                                  wire="bf16"),
                        lambda x, b, t: allreduce(np.ones(600, np.float32), b, timeout=t,
                                                  wire="bf16"),
                        lambda x, b, t: allreduce(np.ones(600, np.float32), b, timeout=t)),
    "compressed pieces": (lambda x, b, t: allreduce(np.ones(3_000_000, np.float32), b,
                                                    timeout=t),
                          lambda x, b, t: allreduce(np.ones(3_000_000, np.float32), b,
                                                    timeout=t, wire="bf16"),
                          lambda x, b, t: allreduce(np.ones(3_000_000, np.float32), b,
                                                    timeout=t)),
    "compressed reduce_scatter": (
        lambda x, b, t: reduce_scatter(np.ones(24, np.float32), b, timeout=t),
        lambda x, b, t: reduce_scatter(np.ones(24, np.float32), b, timeout=t),
        lambda x, b, t: reduce_scatter(np.ones(24, np.float32), b, timeout=t, wire="fp16")),
    "refused": (lambda x, b, t: allreduce(np.ones(4), b, "not an op", timeout=t),
                lambda x, b, t: allreduce(np.ones(4), b, timeout=t),
                lambda x, b, t: allreduce(np.ones(4), b, timeout=t)),
}
#: the cases whose rank 0 raises its own argument error (its peers the mismatch)
REFUSED = {"refused": "ValueError"}


def mismatch(b, nodes=None, timeout=12.0, cases=tuple(DISAGREEMENTS)):
    """The disagreements of :data:`DISAGREEMENTS` named in ``cases`` in turn (``nodes`` None:
    ``b`` has its hierarchy, a simulated one), each followed by an allreduce that
    must agree: per case, (the error's type, seconds to it, the next allreduce's result)."""
    import time

    h = attach_hierarchy(b, nodes) if nodes is not None else b.hierarchy
    which = 0 if b.rank == 0 else 1 if h.members.index(h.node.global_ranks) == 0 else 2
    out = {}
    for name in cases:
        calls = DISAGREEMENTS[name]
        t = time.monotonic()
        try:
            calls[which](None, b, timeout)
            got = "no error"
        except (DistributedError, TypeError, ValueError) as exc:
            got = type(exc).__name__
        took = time.monotonic() - t
        try:
            after = allreduce(np.full(3, b.rank + 1.0), b, timeout=timeout).tolist()
        except DistributedError as exc:
            after = type(exc).__name__
        out[name] = (got, took, after)
    return out


def learned(b, nodes):
    """learn_network on two "nodes": the parameters (the same on every rank), what auto runs
    then at a few sizes, and allreduces still right whatever auto picked."""
    import dataclasses

    from ferro_collective import learn_network
    from ferro_collective.executors import auto_algorithm

    attach_hierarchy(b, nodes)
    p = learn_network(b, timeout=60)
    sizes = (8, 1 << 16, 1 << 22)
    picks = [auto_algorithm("allreduce", s, b) for s in sizes]
    sums = []
    for s in sizes:
        x = np.full(s // 8, float(b.rank + 1))
        sums.append(float(allreduce(x, b)[-1]))
    return {"params": dataclasses.astuple(p), "picks": picks, "sums": sums,
            "cross": dataclasses.astuple(learned_params(b.hierarchy.cross))}


def learned_params(backend):
    from ferro_collective import costmodel

    return costmodel.learned(backend)


def reprobes(b, nodes, seconds):
    """Hierarchical allreduces for ``seconds`` (every rank stopping after the same call); the
    node engine's link probe numbers before and after (None where it cannot probe), and
    whether every result was right."""
    import time

    h = attach_hierarchy(b, nodes)
    engine = h.node.engine
    first = None if engine.link is None else engine.link.probe
    x, right, end = np.ones(4096, np.float32), True, time.monotonic() + seconds
    while True:
        x[1] = time.monotonic() > end
        got = allreduce(x, b)
        right = right and got[0] == b.world_size
        if got[1]:
            break
    return first, None if engine.link is None else engine.link.probe, right
