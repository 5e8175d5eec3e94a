"""Hierarchical collectives for jobs on several nodes: the engine inside a node, the mesh between.

A backend with a :class:`ferro_backend.hierarchy.Hierarchy` (``init_from_env`` attaches one
when the ranks span several hosts) runs allreduce, broadcast, all_gather, reduce_scatter and
barrier as stages on its two groups: ``node`` (this rank's node, on the same-host engine) and
``cross`` (the ranks with this rank's local index on every node, over TCP):

* allreduce: allreduce inside the node (engine, one step), then local rank ``j`` allreduces
  slice ``j`` of the node's result across nodes (so each rank sends 1/L of the data over the
  network), then the node all-gathers the slices. MEAN adds up in both stages and divides once.
* broadcast: the root's cross group broadcasts from the root's node, then every node
  broadcasts from the root's local index.
* all_gather: all-gather inside the node, then across nodes (blocks reordered to rank order).
* reduce_scatter: the hierarchical allreduce, then this rank's slice.
* barrier: node, cross, node.

Whether a call runs staged or flat follows :func:`ferro_collective.costmodel.choose_hierarchical`
(``algorithm="auto"`` only). A simulated network's hierarchy
(``SimulatedBackend.create_group(n, network=..., hierarchical=True)``) runs the same stages with
no engine, in virtual time, which the cost model's "hierarchical" entries are held to.

Every stage is an ordinary collective on its group, with its own header check. The stages'
sequence numbers are taken when the call is made (in issue order), so asynchronous calls in
flight at once still pair up across ranks. Every rank gets the same bits (each slice is
reduced once, by one cross allreduce, then copied); they can differ from the flat
algorithms' bits (the order of additions differs), as between any two algorithms.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ferro_backend.partition import split_bounds

from ._state import state
from .call import finish
from .ops import ReduceOp


def hierarchy_of(backend) -> object | None:
    """The backend's Hierarchy when it has a usable one: several nodes, an engine in each, or
    one built on a simulated network (``Hierarchy.simulated``: no engine, the node stages run
    the point-to-point algorithms over the modelled intra-node links)."""
    h = getattr(backend, "hierarchy", None)
    if h is None or (getattr(h.node, "engine", None) is None
                     and not getattr(h, "simulated", False)):
        return None
    return h


def _seqs(*groups) -> list[int]:
    return [state(g).next_seq() for g in groups]


def allreduce(h, x: np.ndarray, op: ReduceOp, wd: np.dtype, timeout, out
              ) -> Callable[[], np.ndarray]:
    from .api import _all_gather, _allreduce

    node, cross = h.node, h.cross
    s1, s3 = _seqs(node, node)
    (s2,) = _seqs(cross)
    stage_op = ReduceOp.SUM if op is ReduceOp.MEAN else op

    def run() -> np.ndarray:
        work = np.array(x, dtype=wd, order="C", copy=True)
        _allreduce(work, node, stage_op, timeout, None, work, seq=s1).run()
        flat = work.reshape(-1)
        bounds = split_bounds(flat.size, node.world_size)
        lo, hi = bounds[node.rank]
        piece = flat[lo:hi]
        _allreduce(piece, cross, stage_op, timeout, None, piece, seq=s2).run()
        if op is ReduceOp.MEAN:
            np.divide(piece, node.world_size * cross.world_size, out=piece)
        chunk = max(b - a for a, b in bounds)
        send = np.zeros(chunk, wd)
        send[:hi - lo] = piece
        gathered = np.empty(chunk * node.world_size, wd)
        _all_gather(send, node, timeout, None, gathered, seq=s3).run()
        for r, (a, b) in enumerate(bounds):
            flat[a:b] = gathered[r * chunk:r * chunk + b - a]
        return finish(work, x.dtype, out)

    return run


def broadcast(h, x: np.ndarray, root: int, timeout, out) -> Callable[[], np.ndarray]:
    from .api import _broadcast

    node, cross = h.node, h.cross
    root_node = next(k for k, m in enumerate(h.members) if root in m)
    root_local = h.members[root_node].index(root)
    first = node.rank == root_local  # this rank's cross group holds the root
    s1 = _seqs(cross)[0] if first else None
    (s2,) = _seqs(node)

    def run() -> np.ndarray:
        buf = np.empty(x.shape, x.dtype) if out is None else out
        if not np.may_share_memory(buf, x):
            buf[...] = x
        if first:
            _broadcast(buf, cross, root_node, timeout, None, buf, seq=s1).run()
        _broadcast(buf, node, root_local, timeout, None, buf, seq=s2).run()
        return buf

    return run


def all_gather(h, x: np.ndarray, shape: tuple[int, ...], timeout, out
               ) -> Callable[[], np.ndarray]:
    from .api import _all_gather

    node, cross = h.node, h.cross
    (s1,) = _seqs(node)
    (s2,) = _seqs(cross)
    order = [r for m in h.members for r in m]  # block k of the result belongs to rank order[k]

    def run() -> np.ndarray:
        inner = _all_gather(x, node, timeout, None, None, seq=s1).run()
        both = _all_gather(inner, cross, timeout, None, None, seq=s2).run()
        result = np.empty(shape, x.dtype) if out is None else out
        if order == sorted(order):
            result.reshape(-1)[...] = both.reshape(-1)
            return result
        blocks = both.reshape(len(order), -1)
        dst = result.reshape(len(order), -1)
        for k, r in enumerate(order):
            dst[r] = blocks[k]
        return result

    return run


def reduce_scatter(h, x: np.ndarray, op: ReduceOp, wd: np.dtype, out_shape, timeout, out,
                   rank: int) -> Callable[[], np.ndarray]:
    whole = allreduce(h, x, op, wd, timeout, None)

    def run() -> np.ndarray:
        full = whole()
        rows = out_shape[0]
        mine = full[rank * rows:(rank + 1) * rows]
        if out is None:
            return np.array(mine, copy=True)
        out[...] = mine
        return out

    return run


def barrier(h, timeout) -> Callable[[], None]:
    from .api import _barrier_call

    node, cross = h.node, h.cross
    s1, s3 = _seqs(node, node)
    (s2,) = _seqs(cross)

    def run() -> None:
        _barrier_call(node, timeout, s1).run()
        _barrier_call(cross, timeout, s2).run()
        _barrier_call(node, timeout, s3).run()

    return run


__all__ = ["all_gather", "allreduce", "barrier", "broadcast", "hierarchy_of", "reduce_scatter"]
