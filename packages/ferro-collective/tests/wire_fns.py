"""Rank functions for test_wire.py's real-process runs (spawned processes import them)."""

import numpy as np

import ferro_collective as fc
from ferro_collective import ReduceOp
from ferro_collective.wire import decode, encode


def _through(x, wire):
    x = np.asarray(x, np.float32).reshape(-1)
    return decode(encode(x, wire), wire, x.size)


def suite(b) -> list[str]:
    """Every wire format on allreduce (small and past the engine's slot), reduce_scatter and
    all_gather, against the reference; the failures."""
    n, r = b.world_size, b.rank
    bad: list[str] = []
    for wire in ("bf16", "fp16", "int8", "int4"):
        for size in (7, 300_000):
            xs = [np.linspace(-3, 3, size, dtype=np.float32) * (k + 1) + k for k in range(n)]
            acc = _through(xs[0], wire).copy()
            for x in xs[1:]:
                acc += _through(x, wire)
            got = fc.allreduce(xs[r], b, ReduceOp.SUM, wire=wire)
            if not np.array_equal(got, _through(acc, wire)):
                bad.append(f"allreduce {wire} {size}")
        x = np.arange(n * 4, dtype=np.float32) * (r + 1)
        part = sum(_through((np.arange(n * 4, dtype=np.float32) * (k + 1))[r * 4:(r + 1) * 4],
                            wire) for k in range(n))
        if not np.array_equal(fc.reduce_scatter(x, b, wire=wire), part):
            bad.append(f"reduce_scatter {wire}")
        got = fc.all_gather(np.full(3, r + 0.1, np.float32), b, wire=wire)
        want = np.concatenate([_through(np.full(3, k + 0.1), wire) for k in range(n)])
        if not np.array_equal(got, want):
            bad.append(f"all_gather {wire}")
    return bad


def hierarchical(b, nodes) -> list[str]:
    """On two nodes: only the cross-node stage on the wire. The reference: each node's exact
    sum (in float32, as the node stage folds this input), through the wire, folded across
    nodes, through the wire again; the failures."""
    from ferro_backend.hierarchy import attach_hierarchy

    h = attach_hierarchy(b, nodes)
    n, r = b.world_size, b.rank
    members = h.members
    bad: list[str] = []
    for wire in ("bf16", "int8"):
        xs = [np.linspace(-1, 1, 1000, dtype=np.float32) * (k + 1) + 0.01 * k for k in range(n)]
        node_sums = []
        for m in members:
            s = xs[m[0]].copy()
            for k in m[1:]:
                s += xs[k]
            node_sums.append(s)
        # the cross stage folds each local rank's slice; int8 blocks count from the slice's
        # start: the reference per slice
        local = len(members[0])
        per = -(-1000 // local)
        want = np.empty(per * local, np.float32)
        for i in range(local):
            parts = [np.pad(s, (0, per * local - 1000))[i * per:(i + 1) * per]
                     for s in node_sums]
            acc = _through(parts[0], wire).copy()
            for p in parts[1:]:
                acc += _through(p, wire)
            want[i * per:(i + 1) * per] = _through(acc, wire)
        got = fc.allreduce(xs[r], b, wire=wire)
        if not np.array_equal(got, want[:1000]):
            bad.append(f"hierarchical allreduce {wire}: max error "
                       f"{np.abs(got - want[:1000]).max()}")
    return bad
