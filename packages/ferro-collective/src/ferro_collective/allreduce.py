"""allreduce: every rank gets the element-wise reduction of every rank's array.

Where a call runs (:mod:`.dispatch` picks):

- **the engine's door** (``ferro/engine.h``, from the compiled one-call path or the plan's
  engine body on a contiguous copy): up to a slot one step (every rank writes its slot, then
  folds every rank's slot in rank order); from ``FERRO_SHM_SPLIT_BYTES``, and always beyond a
  slot, the split allreduce through rings that wrap (every rank folds one part from the others'
  input rings and gathers the others' parts from their result rings, pipelined in chunks:
  ``_split.h``); float16 and bfloat16 folded in float32 and rounded once;
- **hierarchical** (:func:`stages`): reduce-scatter inside the node, local rank ``j``
  allreduces slice ``j`` across nodes, the node all-gathers the slices (each rank sends 1/L of
  the data over the network), pipelined in pieces when large; MEAN adds up in both stages and
  divides once;
- **Python**: recursive doubling (small), the ring (large), or the star (the reference).

Every path fixes the order in which values are combined; the engine's paths fold in rank order,
as "star" does, so their bits equal ``algorithm="star"``'s on every rank.
"""

from __future__ import annotations

import concurrent.futures
import functools

import numpy as np

from ferro_backend.partition import split_bounds

from . import _onecall, all_gather, gathered, pair, per_backend
from .arguments import as_array, check_out, finish, same_buffer
from .engine_group import EngineGroup, Step, door_calls
from .ops import CODES, OPS, ReduceOp, accumulate, as_op, fold, work_dtype
from .p2p import Ctx, all_gather_ring_into, fold_at_root, reduce_scatter_ring_into
from .per_backend import reserve
from .pipeline import PIPELINE_MIN, PIPELINE_PIECE, schedule, writable_into
from .plan import Collective, Plan, choose, gathered_or_first
from .scratch import POOL


def prepare(tensor, backend, op, timeout, algorithm, out, seq: int | None = None) -> Plan:
    """The checked plan of one allreduce."""
    x = as_array("allreduce", tensor, backend)
    op = as_op(op)
    wd = work_dtype("allreduce", x.dtype, op)
    n = backend.world_size
    algo = choose(ALLREDUCE, algorithm, x.nbytes, n, backend)
    out = check_out("allreduce", out, x.shape, x.dtype)

    def python(ctx: Ctx) -> np.ndarray:
        if out is not None and wd == x.dtype:
            buf = out.reshape(-1)
            if not same_buffer(out, x):  # (numpy copies an overlapping x as if read first)
                buf[...] = x.reshape(-1)
        else:
            buf = np.array(x, dtype=wd, order="C", copy=True).reshape(-1)
        if n > 1 and buf.size:
            IMPLEMENTATIONS[algo](ctx, buf, op)
        return finish(buf.reshape(x.shape), x.dtype, out)

    def engine(group: EngineGroup, call: Step, header: bytes) -> np.ndarray:
        result = np.empty(x.shape, x.dtype) if out is None else out
        group.door(call, door_calls.ALLREDUCE, np.ascontiguousarray(x), result, CODES[x.dtype],
                   OPS[op].door, shape=x.shape)
        return result

    def two(ctx: Ctx, header: bytes) -> np.ndarray:
        return pair.allreduce(ctx, header, x, wd, op, out)

    def many(ctx: Ctx, header: bytes) -> np.ndarray:
        return gathered.allreduce(ctx, header, x, wd, op, out)

    nbytes = x.size * wd.itemsize
    return Plan("allreduce", backend, timeout, (x.dtype, x.shape, op, -1), python, engine,
                lambda h: stages(h, x, op, wd, timeout, out), algorithm, seq,
                (two if nbytes <= pair.FUSE_MAX else None) if n == 2 else
                gathered_or_first("allreduce", nbytes, n, backend, many, python))


# ----------------------------------------------------------------------------- Python
def allreduce_star(ctx: Ctx, buf: np.ndarray, op: ReduceOp) -> None:
    tag_up, tag_down = ctx.next_tag(), ctx.next_tag()
    if ctx.rank == 0:
        fold_at_root(ctx, buf, op, tag_up)
        for r in range(1, ctx.n):
            ctx.send(buf, r, tag_down)
    else:
        req = ctx.irecv(buf, 0, tag_down)
        ctx.send(ctx.copy(buf), 0, tag_up)
        ctx.wait(req, 0, "the result")


def allreduce_ring(ctx: Ctx, buf: np.ndarray, op: ReduceOp) -> None:
    bounds = split_bounds(buf.size, ctx.n)
    mean = ctx.n if op is ReduceOp.MEAN else None
    owned = reduce_scatter_ring_into(ctx, buf, op, bounds, mean)
    all_gather_ring_into(ctx, buf, bounds, owned)


def allreduce_recursive_doubling(ctx: Ctx, buf: np.ndarray, op: ReduceOp) -> None:
    n, me = ctx.n, ctx.rank
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    mean = n if op is ReduceOp.MEAN else None
    tag_fold, tag_unfold = ctx.next_tag(), ctx.next_tag()
    if me >= p:  # fold into partner me - p, wait for the result
        req = ctx.irecv(buf, me - p, tag_unfold)
        ctx.send(ctx.copy(buf), me - p, tag_fold)
        ctx.wait(req, me - p, "the result")
        return
    incoming = ctx.take(buf.size, buf.dtype)
    if me + p < n:
        req = ctx.irecv(incoming, me + p, tag_fold)
        ctx.wait(req, me + p, "its contribution")
        accumulate(buf, incoming, op)
    distance = 1
    while distance < p:
        partner = me ^ distance
        tag = ctx.next_tag()
        req = ctx.irecv(incoming, partner, tag)
        ctx.send(buf, partner, tag)
        ctx.wait(req, partner, f"the round-{distance.bit_length()} partial result")
        last = distance * 2 >= p
        # Combine lower-rank operand first on both partners: identical bits on both sides.
        if partner < me:  # the partner's data is the lower operand: first, folded into buf
            fold(buf, [incoming, buf], op, mean if last else None)  # (no copy back)
        else:
            accumulate(buf, incoming, op, mean if last else None)
        distance *= 2
    if me + p < n:
        ctx.send(buf, me + p, tag_unfold)


IMPLEMENTATIONS = {"ring": allreduce_ring, "recursive_doubling": allreduce_recursive_doubling,
              "star": allreduce_star}


# ----------------------------------------------------------------------------- hierarchical
def stages(h, x: np.ndarray, op: ReduceOp, wd: np.dtype, timeout, out):
    """Reduce-scatter inside the node, local rank ``j`` allreduces its part across nodes, the
    node all-gathers the parts; large calls as a pipeline of pieces (PIPELINE_PIECE), each
    piece's cross stage on the cross group's worker thread while this thread runs the next
    piece's node stages. Sequence numbers are reserved now, in the order every rank issues
    the calls; returns ``run(execute)``, which hands each stage's plan to the dispatcher."""
    node, cross = h.node, h.cross
    n_local = node.world_size
    stage_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
    nbytes = x.size * wd.itemsize
    # on a node's engine the first stage is a reduce-scatter (one step) and large calls are
    # pipelined; a simulated hierarchy's node stages run point-to-point, where a ring
    # reduce-scatter costs more steps than auto's allreduce at small sizes: it keeps the
    # allreduce, unpipelined (what costmodel.hierarchical_stages describes)
    engine = node.engine is not None
    k = 1 if nbytes < PIPELINE_MIN or not engine else -(-nbytes // PIPELINE_PIECE)
    order = schedule(k)
    node_seq = dict(zip(order, reserve(*[node] * len(order)), strict=True))
    cross_seq = reserve(*[cross] * k)
    divide = node.world_size * cross.world_size if op is ReduceOp.MEAN else 0

    def across(p: int, part: np.ndarray, execute) -> None:
        execute(prepare(part, cross, stage_op, timeout, None, part, cross_seq[p]))
        if divide:
            np.divide(part, divide, out=part)

    def run(execute) -> np.ndarray:
        # on an engine the stages read x and write the result where it goes when no dtype
        # conversion is due: no copy in and out of a working array (4 nodes x 2 ranks, 64 MiB:
        # two passes over fresh pages on an oversubscribed host)
        if engine and wd == x.dtype:
            src = np.ascontiguousarray(x).reshape(-1)
            result = out if writable_into(out, x) else np.empty(x.shape, x.dtype)
            dst = result.reshape(-1)
        else:
            result = np.array(x, dtype=wd, order="C", copy=True)
            src = dst = result.reshape(-1)
        pieces = split_bounds(src.size, k)
        parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        pending, borrowed = {}, []  # the parts: from the scratch pool, given back at the end
        worker = per_backend.state(cross)
        try:
            for step, p in order:
                a, b = pieces[p]
                chunk = max(1, -(-(b - a) // n_local))
                direct = b - a == chunk * n_local  # else padded: a piece of a few elements
                if step == "rs":
                    whole = src[a:b] if direct else np.zeros(chunk * n_local, wd)
                    if not direct:
                        whole[:b - a] = src[a:b]
                    if engine:
                        part = POOL.take(chunk, wd)
                        borrowed.append(part)
                        execute(execute.prepare("reduce_scatter", whole, node, stage_op,
                                                timeout, None, part, node_seq[step, p]))
                        whole = dst[a:b] if direct else whole
                    else:
                        execute(prepare(whole, node, stage_op, timeout, None, whole,
                                        node_seq[step, p]))
                        me = node.rank * chunk
                        part = whole[me:me + chunk].copy()
                    parts[p] = (whole, part)
                    job = functools.partial(across, p, part, execute)
                    pending[p] = worker.submit(job) if k > 1 else _in_line(job)
                else:
                    pending.pop(p).result()
                    whole, part = parts.pop(p)
                    execute(all_gather.prepare(part, node, None, timeout, None, whole,
                                               node_seq[step, p]))
                    if not direct:
                        dst[a:b] = whole[:b - a]
            POOL.give(*borrowed)  # every stage done (after a failure one may still write)
        finally:
            for f in pending.values():  # a failed stage: the others end by their deadlines
                f.cancel()
        return finish(result, x.dtype, out)

    return run


def _in_line(job) -> concurrent.futures.Future:
    """``job()`` run now, as a future (a call in one piece: its cross-node stage in this
    thread, without a worker's round trip)."""
    f: concurrent.futures.Future = concurrent.futures.Future()
    try:
        f.set_result(job())
    except BaseException as exc:  # (raised where its result is asked for, as a worker's)
        f.set_exception(exc)
    return f


ALLREDUCE = Collective("allreduce", prepare, _onecall.ALLREDUCE,
                       ("auto", "ring", "recursive_doubling", "star"),
                       torch="all_reduce", jax="allreduce")

__all__ = ["ALLREDUCE", "IMPLEMENTATIONS", "prepare", "stages"]
