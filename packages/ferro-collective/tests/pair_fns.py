"""Module-level rank functions for the tests of two-rank calls that send their header with
their data (:mod:`ferro_collective.pair`): threads and spawned processes run the same."""

import time

import numpy as np

from ferro_backend import CollectiveMismatchError
from ferro_collective import (
    ReduceOp,
    all_gather,
    all_gather_v,
    all_to_all,
    all_to_all_single,
    allreduce,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
)


def _allreduce(n, **kw):
    return lambda b, t: allreduce(np.ones(n, np.float32), b, timeout=t, **kw)


#: disagreements of two ranks: (name, rank 0's call, rank 1's call, what the error names)
#: (each call: ``f(backend, timeout)``), each meeting the disagreement another way at its
#: first message: headers that differ in a message of the right length, messages of other
#: lengths (a call of another size, one whose header travels alone), the same call run in
#: another form
DISAGREEMENTS = [
    ("sizes", _allreduce(600), _allreduce(601), ["float32[600]", "float32[601]"]),
    ("ops", _allreduce(8), _allreduce(8, op=ReduceOp.MEAN), ["SUM", "MEAN"]),
    ("broadcast", _allreduce(4), lambda b, t: broadcast(np.zeros(4, np.float32), b, 0,
                                                         timeout=t),
     ["allreduce(float32[4], SUM)", "broadcast(float32[4], root=0)"]),
    ("gather", lambda b, t: all_gather(np.ones(3), b, timeout=t),
     lambda b, t: gather(np.ones(3), b, 0, timeout=t), ["all_gather", "gather"]),
    ("kinds", lambda b, t: reduce_scatter(np.ones(60, np.float32), b, timeout=t),
     lambda b, t: all_gather(np.ones(30, np.float32), b, timeout=t),
     ["reduce_scatter(float32[60]", "all_gather(float32[30]"]),
    ("large", _allreduce(16), _allreduce(1 << 19), ["float32[16]", "float32[524288]"]),
    ("barrier", lambda b, t: barrier(b, timeout=t), _allreduce(4), ["barrier", "allreduce"]),
    ("form", _allreduce(16), _allreduce(16, algorithm="ring"), ["another form"]),
    # to a root: the root's message is its header alone
    ("roots", lambda b, t: gather(np.ones(3), b, 0, timeout=t),
     lambda b, t: gather(np.ones(3), b, 1, timeout=t), ["root=0", "root=1"]),
    ("rooted", lambda b, t: reduce(np.ones(4, np.float32), b, 1, timeout=t),
     lambda b, t: gather(np.ones(4, np.float32), b, 1, timeout=t), ["reduce(", "gather("]),
    ("broadcast-roots", lambda b, t: broadcast(np.ones(4), b, 0, timeout=t),
     lambda b, t: broadcast(np.ones(4), b, 1, timeout=t), ["root=0", "root=1"]),
    # (three ranks or more: only the root's unit carries data, so messages of the expected
    # length may hold units placed for another size or root)
    ("broadcast-sizes", lambda b, t: broadcast(np.ones(4), b, 0, timeout=t),
     lambda b, t: broadcast(np.ones(5), b, 0, timeout=t), ["float64[4]", "float64[5]"]),
    ("broadcast-form", lambda b, t: broadcast(np.ones(4), b, 0, timeout=t),
     lambda b, t: broadcast(np.ones(4), b, 0, timeout=t, algorithm="tree"),
     ["another form"]),

    # a broadcast's non-root that passed None (it cannot receive a message of unknown length)
    ("none-allreduce", _allreduce(4), lambda b, t: broadcast(None, b, 0, timeout=t),
     ["allreduce(float32[4], SUM)", "broadcast"]),
    ("none-barrier", lambda b, t: barrier(b, timeout=t),
     lambda b, t: broadcast(None, b, 0, timeout=t), ["barrier", "broadcast"]),
    ("none-dims", lambda b, t: broadcast(np.ones((1,) * 7), b, 0, timeout=t),
     lambda b, t: broadcast(None, b, 0, timeout=t), ["7 dims"]),
    ("none-none", lambda b, t: broadcast(None, b, 1, timeout=t),
     lambda b, t: broadcast(None, b, 0, timeout=t), ["broadcast"]),
    # collectives with a metadata round (header and metadata in one message each way)
    ("metadata", lambda b, t: all_to_all([np.ones(2 + i) for i in range(b.world_size)], b,
                                          timeout=t),
     lambda b, t: all_gather_v(np.ones(2), b, timeout=t), ["all_to_all", "all_gather_v"]),
    ("metadata-fused", lambda b, t: all_to_all_single(np.ones(60, np.float32), b, timeout=t),
     _allreduce(60), ["all_to_all_single", "allreduce(float32[60], SUM)"]),
    ("metadata-dims", lambda b, t: all_gather_v(np.ones((2, 3)), b, timeout=t),
     lambda b, t: all_gather_v(np.ones((2, 4)), b, timeout=t), ["[*, 3]", "[*, 4]"]),
]


#: the cases that only two ranks can make (each rank the other's broadcast's root)
TWO_ONLY = frozenset({"none-none"})


def disagree(b, timeout: float = 8.0, odd: int = 1):
    """Every disagreement in turn, each followed by an agreeing allreduce: per case, what this
    rank raised (its type and message), how long it took, and the next call's result (rank
    ``odd`` makes the second call of each case, the others the first; not rank 0 where there
    are more than two: a broadcast's root)."""
    out = {}
    for name, mine, theirs, _ in DISAGREEMENTS:
        if b.world_size > 2 and name in TWO_ONLY:
            continue
        t0 = time.monotonic()
        try:
            (theirs if b.rank == odd else mine)(b, timeout)
            got = ("returned", "")
        except Exception as exc:  # (the test compares what each rank raised)
            got = (type(exc).__name__, str(exc))
        took = time.monotonic() - t0
        after = allreduce(np.full(3, 1.0), b, timeout=timeout).tolist()
        out[name] = (got, took, after)
    return out


def other_form(b, timeout: float = 8.0) -> dict:
    """A gather and a reduce of two ranks to either root where rank 1 runs them in another
    form (``pair.FUSE_MAX`` -1 there: its header exchange, then the tree, as a rank set up
    otherwise would): what each rank raised, how long it took, and an agreeing allreduce
    after it. A root's message without data must not read as the header exchange's."""
    from ferro_collective import pair

    out, fuse = {}, pair.FUSE_MAX
    for root in (0, 1):
        for name, call in (("gather", gather), ("reduce", reduce)):
            t0 = time.monotonic()
            pair.FUSE_MAX = -1 if b.rank == 1 else fuse
            try:
                call(np.ones(3), b, root, timeout=timeout)
                got = ("returned", "")
            except Exception as exc:  # (the test compares what each rank raised)
                got = (type(exc).__name__, str(exc))
            pair.FUSE_MAX = fuse
            took = time.monotonic() - t0
            after = allreduce(np.full(3, 1.0), b, timeout=timeout).tolist()
            out[f"{name} {root}"] = (got, took, after)
    return out


def sends(b, calls):
    """How many messages this rank sends in each of ``calls`` (name -> no-argument function)."""
    sent = [0]
    real = b.send

    def send(data, dst, *, tag=0):
        sent[0] += 1
        return real(data, dst, tag=tag)

    b.send = send
    out = {}
    try:
        for name, call in calls:
            sent[0] = 0
            out[name] = (call(), sent[0])
    finally:
        del b.send
    return out


def counted(b, sizes):
    """How many messages this rank sends per allreduce / all_gather / reduce_scatter of each
    size (bytes of float32), with the mismatch check on."""
    calls = []
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        for name, call, kw in (("allreduce", allreduce, {}), ("all_gather", all_gather, {}),
                               ("reduce_scatter", reduce_scatter, {}),
                               ("ring", allreduce, {"algorithm": "ring"}),
                               ("all_to_all_single", all_to_all_single, {}),
                               ("gather", gather, {}), ("reduce", reduce, {"root": 1}),
                               ("broadcast", broadcast, {})):
            calls.append((f"{name} {nbytes}", lambda c=call, x=x, kw=kw: c(x, b, **kw)))
    return {name: count for name, (_, count) in sends(b, calls).items()}


def from_root(b, steps):
    """Broadcasts from rank 0, one per step ``(nbytes, none)``: ``nbytes`` of float32 (0:
    bfloat16 of shape (2, 3)), rank 1 passing None where ``none`` (mpi4py's habit) else an
    array; returns per step what this rank got (shape, whether right) and how many messages it
    sent."""
    from ferro_collective.ops import BFLOAT16

    def call(nbytes, none):
        x = np.arange(nbytes // 4, dtype=np.float32) if nbytes else \
            np.arange(6).reshape(2, 3).astype(BFLOAT16)
        got = broadcast(x if b.rank == 0 else None if none else np.empty_like(x), b, 0,
                        timeout=8)
        return got.shape, got.tobytes() == x.tobytes()

    got = sends(b, [(i, lambda step=step: call(*step)) for i, step in enumerate(steps)])
    return [(*got[i][0], got[i][1]) for i in range(len(steps))]


__all__ = ["DISAGREEMENTS", "TWO_ONLY", "CollectiveMismatchError", "counted", "disagree", "from_root",
           "sends"]
