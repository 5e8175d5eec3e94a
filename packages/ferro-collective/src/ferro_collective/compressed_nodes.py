"""The compressed collectives of a multi-node job (:mod:`.compressed` calls them where the
backend's hierarchy has several nodes): exact inside each node, compressed across nodes only.

- :func:`node_calls`: one allreduce as four collectives, the node's exact reduce_scatter, the
  compressed allreduce of this local rank's slice across the nodes, the node's all_gather;
- :func:`node_pieces`: an allreduce in pieces whose cross-node stages overlap;
- :func:`reduce_scatter_nodes`: a bf16/fp16 reduce_scatter, the node's exact one, then an
  all-to-all of the encoded sums across the nodes.

(A call on one group, :mod:`.compressed`'s, takes a fixed block of sequence numbers; these
number their node and cross-node stages as they run.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from ferro_backend import Backend

from .compressed_agreement import PREFIX, Numbers
from .compressed_steps import Steps, deliver, encode_chunks, flat_allreduce, fold_rows
from .ops import ReduceOp
from .records import ALL_GATHER, ALL_TO_ALL_SINGLE, REDUCE_SCATTER
from .wire import encoded_bytes


def node_calls(s: Steps, x: np.ndarray, h, op: ReduceOp, out,
               who: np.ndarray | None = None, feedback=None) -> None:
    """Add the multi-node allreduce of ``x`` to ``s``: the node's exact reduce_scatter (call
    0), the compressed allreduce across the nodes of this local rank's slice (calls 1, 2; with
    ``who``, the call's identity, the first carries it and decides the call, and the node
    agrees on that between them: :meth:`Steps.agreement`), the node's all_gather (the last
    call); then ``s.result``. ``feedback``: the cross-node stage's (:class:`~.wire.Feedback`)."""
    flat, backend = x.reshape(-1), s.backend
    local = h.local_world
    per = -(-max(1, flat.size) // local)
    padded = s.take(per * local, dtype=x.dtype)
    padded[:flat.size] = flat
    padded[flat.size:] = 0
    node_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
    part32 = s.take(per, dtype=np.float32)   # the node's sum of this local rank's slice
    part = s.take(per, dtype=x.dtype)         # ... folded across the nodes
    node_sum = s.take(per, dtype=x.dtype)     # (the node stage's result)
    whole = s.take(per * local, dtype=x.dtype)

    def summed(got):
        part32[...] = got
        encode_cross()

    def crossed(fill):
        if part.dtype == np.float32:
            fill(part)
        else:
            part[...] = _filled(fill, per)

    def gathered(got):
        got = got[:flat.size]
        if op is ReduceOp.MEAN:
            np.divide(got, np.asarray(backend.world_size, got.dtype), out=got)

        def fill(dest):
            dest[...] = got

        s.result = deliver(fill, x, x.shape, out, "allreduce")

    s.then(REDUCE_SCATTER, padded, h.node, node_op, node_sum, summed)
    encode_cross = flat_allreduce(s, part32, h.cross, node_op, crossed, who, h.node, feedback)
    s.then(ALL_GATHER, part, h.node, None, whole, gathered)


def node_pieces(flat: np.ndarray, pieces: list[tuple[int, int]], h, backend: Backend,
                op: ReduceOp, wire: str, timeout, into: np.ndarray,
                on_error: Callable[[BaseException], None], numbers: Numbers,
                who: np.ndarray) -> tuple[int, list]:
    """A multi-node allreduce in pieces whose cross-node stages overlap: the node
    reduce_scatters of every piece one after another, each piece's compressed cross-node
    allreduce as soon as its node stage is done, the node all_gathers in order as the pieces
    come back. (Each piece a whole hierarchical call would run its node all_gather before the
    next piece's reduce_scatter: the engine runs a group's calls in their order, so the
    pieces' cross stages could not overlap.) Every call is numbered now, each group's in the
    same order on every rank, taking the call's ``numbers``. The first piece's cross-node
    all-to-all carries ``who``, the whole call's identity, and decides the call: the other
    pieces' reduce_scatters wait for it (a rank whose call is not cut, or cut otherwise, runs
    one node stage before its decider too). Returns the first call's number and the jobs, to
    run in order (each waits only for jobs before it, so the workers, which start jobs in
    order, run them whatever their number)."""
    ss = [Steps("allreduce", wire, flat[lo:hi], backend, timeout, on_error, numbers)
          for lo, hi in pieces]
    for k, ((lo, hi), s) in enumerate(zip(pieces, ss)):
        node_calls(s, flat[lo:hi], h, op, into[lo:hi], who if k == 0 else None)
    # node: the first piece's reduce_scatter and agreement, the others' reduce_scatters, then
    # every all_gather; cross: each piece's all-to-all and all-gather in turn
    ss[0].number([0, 1, 2])
    for s in ss[1:]:
        s.number([0])
    ss[0].number([3])
    for s in ss[1:]:
        s.number([1, 2])
    for s in ss:
        s.number([len(s.calls) - 1])
    node_done = [threading.Event() for _ in ss]
    cross_done = [threading.Event() for _ in ss]
    decided = threading.Event()

    def part(s: Steps, calls: list[int], after: threading.Event | None = None,
             done: threading.Event | None = None) -> Callable[[], None]:
        """A job: once ``after`` is set, run piece ``s``'s ``calls``; then set ``done``."""
        def job():
            try:
                if after is not None:
                    after.wait()
                s.run_numbered(calls)
            except BaseException as exc:
                s.fail(exc)
            finally:
                if done is not None:
                    done.set()
        return job

    def first():  # the first piece's node stage, decider and agreement, the other node stages
        part(ss[0], [0], done=node_done[0])()
        part(ss[0], [1, 2], done=decided)()
        for s, done in zip(ss[1:], node_done[1:]):
            part(s, [0], done=done)()

    def gathers():
        for s, crossed in zip(ss, cross_done):
            part(s, [len(s.calls) - 1], after=crossed)()
        for s in ss:
            s.close()

    crosses = [part(ss[0], [3], decided, cross_done[0])]
    crosses += [part(s, [1, 2], after, done)
                for s, after, done in zip(ss[1:], node_done[1:], cross_done[1:])]
    return ss[0].runs[0][0], [first, *crosses, gathers]


def refuse(name: str, backend: Backend, h, wire: str, timeout, error: BaseException,
           numbers: Numbers) -> None:
    """This rank refuses a multi-node allreduce or bf16/fp16 reduce_scatter (its own arguments
    were wrong: ``error``): in the background, it takes part in the call's first collectives
    as a rank that failed, so that every rank raises there (an empty node reduce_scatter, which
    its node meets as a mismatch; the cross-node all-to-all, carrying the refusal with
    ``error``'s message; the node's agreement), its other numbers given back."""
    s = Steps(name, str(wire), np.empty(0, np.float32), backend, timeout, numbers=numbers)
    s.fail(error)
    s.abandons = False  # (its peers' deadline is theirs: an exact call's refusal ends nothing)
    empty = np.empty(0, np.float32)
    s.then(REDUCE_SCATTER, empty, h.node, ReduceOp.SUM, s.take(0, dtype=np.float32),
           lambda got: None)
    p = s.carry(np.zeros(PREFIX, np.uint8), h.cross)
    s.then(ALL_TO_ALL_SINGLE, s.take(h.num_nodes, p), h.cross, (None, None),
           s.take(h.num_nodes, p), lambda got: None)
    s.agreement(h.node)
    s.run(True)  # (numbered now; its Work raises error, which this rank raises already)


def _filled(fill: Callable[[np.ndarray], None], count: int) -> np.ndarray:
    result = np.empty(count, np.float32)
    fill(result)
    return result


def reduce_scatter_nodes(x: np.ndarray, tensor, h, backend: Backend, op: ReduceOp, wire: str,
                         timeout, out, shape: tuple, numbers: Numbers, who: np.ndarray) -> Steps:
    """The bf16/fp16 reduce_scatter of a multi-node job: exact inside the node, compressed
    across nodes. Local rank ``i`` of every node gets, from an exact reduce_scatter over its
    node, its node's sum of the blocks of the ranks of local index ``i`` (in node order); those
    are encoded, all-to-all'd across the nodes and folded in node order (every hierarchy's nodes
    hold the same number of ranks). (int8/int4 stay flat: their error feedback needs what this
    rank's own blocks lost in the encoding.) Returns its :class:`Steps` (taking ``numbers``;
    the all-to-all carries ``who``, the call's identity, and decides the call, and the node
    agrees on that after it: :meth:`Steps.agreement`)."""
    n, local, nodes = backend.world_size, h.local_world, h.num_nodes
    per = int(np.prod(shape))
    s = Steps("reduce_scatter", wire, tensor, backend, timeout, numbers=numbers)
    blocks = x.reshape(n, per)
    grouped = s.take(local, nodes, per, dtype=x.dtype)
    for k, members in enumerate(h.members):
        for i, r in enumerate(members):
            grouped[i, k] = blocks[r]
    node_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
    node_sum = s.take(nodes * per, dtype=x.dtype)
    width = encoded_bytes(per, wire)
    s.encoded = nodes * width

    def summed(got):
        encode_chunks(np.ascontiguousarray(got, dtype=np.float32), per, per, wire, sent[:, p:])

    def folded(got):
        fold_rows(got.reshape(nodes, p + width)[:, p:], wire, node_op, acc)
        if op is ReduceOp.MEAN:
            np.divide(acc, np.float32(n), out=acc)

        def fill(dest):
            dest[...] = acc

        s.result = deliver(fill, x, shape, out, "reduce_scatter")

    s.then(REDUCE_SCATTER, grouped.reshape(-1), h.node, node_op, node_sum, summed)
    p = s.carry(who, h.cross, lambda w: PREFIX + encoded_bytes(per, w))
    sent, rows = s.take(nodes, p + width), s.take(nodes, p + width)
    acc = s.take(per, dtype=np.float32)
    sent[:, :p] = who
    s.then(ALL_TO_ALL_SINGLE, sent, h.cross, (None, None), rows, folded)
    s.agreement(h.node)
    return s
