"""allreduce: every rank gets the element-wise reduction of every rank's array.

Where a call runs (:mod:`.dispatch` picks):

- **one engine call** (:func:`fold_plan`, run by the compiled path) when the data fits a slot:
  every rank writes its slot, then folds every rank's slot in rank order (the fold kernel of
  ``_reduce``, run by the engine);
- **staged on the engine** (:func:`engine_allreduce`): beyond a slot the split allreduce
  through rings that wrap (every rank folds one part from the others' input rings and gathers
  the others' parts from their result rings, pipelined in chunks: ``_split.h``); without the
  split (``FERRO_SHM_SPLIT_BYTES=0``), where ranks may read each other's memory, a
  reduce-scatter that folds each rank's chunk of every rank's input straight from the peers'
  memory, piece by piece, then an all-gather of the chunks; else slot-sized pieces;
- **hierarchical** (:func:`stages`): reduce-scatter inside the node, local rank ``j``
  allreduces slice ``j`` across nodes, the node all-gathers the slices (each rank sends 1/L of
  the data over the network), pipelined in pieces when large; MEAN adds up in both stages and
  divides once;
- **Python**: recursive doubling (small), the ring (large), or the star (the reference).

Every path fixes the order in which values are combined; the engine's paths fold in rank order,
as "star" does, so their bits equal ``algorithm="star"``'s on every rank.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from ferro_backend.partition import split_bounds

from . import _fastcall, _reduce, _state, all_gather
from ._state import reserve
from .checks import as_array, check_out, finish
from .engine import OK, EngineGroup, FastPlan, Step, one_call_header
from .ops import BITWISE, OPS, ReduceOp, accumulate, as_op, work_dtype
from .p2p import Ctx, all_gather_ring_into, fold_at_root, reduce_scatter_ring_into
from .pipeline import PIPELINE_MIN, PIPELINE_PIECE, schedule, writable_into
from .plan import PREPARE, Plan, choose
from .scratch import POOL

#: bytes of each peer's input read and folded at once by the large reduction
PIECE_BYTES = 512 << 10
#: kernel dtype -> the fold kernel's dtype code (float codes first, then the integers)
CODES = {np.dtype(name): code for name, code in _reduce.DTYPE_CODES.items()}
_FIRST_INT_CODE = _reduce.DTYPE_CODES["int8"]


def fold_plan(group: EngineGroup, x: np.ndarray, op: ReduceOp,
              name: str = "allreduce") -> FastPlan | None:
    """The one-call plan of a reduction (``name``: allreduce or reduce_scatter) of ``x``'s
    signature, made once per signature by the compiled path, or None when one engine step
    cannot run it (the general path then checks the call)."""
    code, n = CODES.get(x.dtype), group.n
    if (code is None or x.nbytes > group.slot_bytes
            or (op is ReduceOp.MEAN and code >= _FIRST_INT_CODE)
            or (op in BITWISE and code < _FIRST_INT_CODE)):
        return None
    div = float(n) if op is ReduceOp.MEAN else 0.0
    header, h = one_call_header(name, x.dtype, x.shape, op)
    if name == "allreduce":
        return FastPlan.fold(name, header, x.shape, h, code, OPS[op].kernel, div, 0, x.size)
    if x.ndim and x.shape[0] % n == 0:  # reduce_scatter: this rank's part of every slot
        part = x.size // n
        return FastPlan.fold(name, header, (x.shape[0] // n, *x.shape[1:]), h, code,
                             OPS[op].kernel, div, group.me * part * x.itemsize, part)
    return None


_fastcall.register(_fastcall.ALLREDUCE, fold_plan)


def prepare(tensor, backend, op, timeout, algorithm, out, seq: int | None = None) -> Plan:
    """The checked plan of one allreduce."""
    x = as_array("allreduce", tensor, backend)
    op = as_op(op)
    wd = work_dtype("allreduce", x.dtype, op)
    n = backend.world_size
    algo = choose("allreduce", algorithm, x.nbytes, n, backend)
    out = check_out("allreduce", out, x.shape, x.dtype)

    def python(ctx: Ctx) -> np.ndarray:
        if out is not None and wd == x.dtype:
            buf = out.reshape(-1)
            if not np.may_share_memory(out, x):
                buf[...] = x.reshape(-1)
        else:
            buf = np.array(x, dtype=wd, order="C", copy=True).reshape(-1)
        if n > 1 and buf.size:
            IMPLEMENTATIONS[algo](ctx, buf, op)
        return finish(buf.reshape(x.shape), x.dtype, out)

    def engine(group: EngineGroup, call: Step, header: bytes) -> np.ndarray:
        result = np.empty(x.shape, x.dtype) if out is None else out
        engine_allreduce(group, call, header, np.ascontiguousarray(x).reshape(-1),
                         result.reshape(-1), wd, op)
        return result

    return Plan("allreduce", backend, timeout, (x.dtype, x.shape, op, -1), python, engine,
                lambda h: stages(h, x, op, wd, timeout, out), algorithm, seq)


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
            _fold(buf, [incoming, buf], op, mean if last else None)  # (no copy back)
        else:
            accumulate(buf, incoming, op, mean if last else None)
        distance *= 2
    if me + p < n:
        ctx.send(buf, me + p, tag_unfold)


IMPLEMENTATIONS = {"ring": allreduce_ring, "recursive_doubling": allreduce_recursive_doubling,
              "star": allreduce_star}


# ----------------------------------------------------------------------------- engine
def engine_allreduce(g: EngineGroup, call: Step, header: bytes, x: np.ndarray, out: np.ndarray,
                     wd: np.dtype, op: ReduceOp) -> None:
    """``out`` (1-d, x's dtype) = the rank-order fold of every rank's ``x`` (1-d)."""
    mean = g.n if op is ReduceOp.MEAN else None
    if x.dtype == wd and x.dtype in CODES and x.size and (
            x.nbytes <= g.slot_bytes or g.slots.split_fits(x.nbytes, x.size)):
        # the compiled path's step within a slot (split from the engine's threshold):
        # whichever path a rank takes for a call, its peers must find the same protocol; beyond
        # a slot, split through rings that wrap (2 ranks, 8 MiB: 1.5-1.7 ms by cross-memory
        # reads before)
        split_step(g, call, header, x, out, op, mean)
    elif x.size * wd.itemsize <= g.slot_bytes:
        fold_through_slots(g, call, header, x, out, wd, op, mean)
    elif g.cma_ok:
        bounds = split_bounds(x.size, g.n)
        g.exchange(call, header, extra=(os.getpid(), x.ctypes.data, out.ctypes.data))
        extras = g.extras()
        s, e = bounds[g.me]
        fold_from_peers(g, x, out[s:e], wd, op, mean, extras, s, e)
        g.sync(call)  # every chunk is reduced
        for r, (rs, re) in enumerate(bounds):
            if r != g.me and re > rs:
                g.read(r, extras[r][2] + rs * out.itemsize, out[rs:re])
        g.sync(call)  # nobody reads our buffers any more
    else:
        per = max(1, g.slot_bytes // wd.itemsize)
        for s in range(0, x.size, per):
            e = min(x.size, s + per)
            fold_through_slots(g, call, header, x[s:e], out[s:e], wd, op, mean)


def split_step(g: EngineGroup, call: Step, header: bytes, x: np.ndarray, out: np.ndarray,
               op: ReduceOp, mean: int | None, scatter: bool = False) -> None:
    """One engine allreduce call of ``x`` as the compiled path runs it within a slot (split
    from the engine's threshold), split through rings beyond (``SlotEngine.step_allreduce``);
    ``scatter``: a split reduce_scatter (``out``: this rank's part)."""
    code, kernel, div = CODES[x.dtype], OPS[op].kernel, float(mean or 0)
    rc = g.slots.step_allreduce(header, call.seq & 0xFFFFFFFF, x, out, x.size, code, kernel,
                                div, call.soft, scatter)
    if rc != OK:
        g._recover(rc, call.name, call.seq, call.timeout, call.start)
        rc = g.slots.fold(out, x.nbytes, 0, x.size, x.itemsize, code, kernel, div, call.hard)
        if rc != OK:
            g._late(rc, call.name, call.seq, call.timeout, call.start)


def fold_through_slots(g: EngineGroup, call: Step, header: bytes, x: np.ndarray,
                       out: np.ndarray, wd: np.dtype, op: ReduceOp, mean: int | None,
                       part: tuple[int, int] | None = None) -> None:
    """One step: every rank's ``x`` through its slot, then ``out`` = the fold of ``[s:e]``
    (``part``; default all) of every slot."""
    span = x.size * wd.itemsize  # placed as the compiled path places it
    if x.dtype == wd:
        step = g.exchange(call, header, x, span=span)
    else:  # widened: the slot holds the work dtype, so peers need not convert
        np.copyto(g.slot_for_writing(span, wd, span), x, casting="unsafe")
        step = g.exchange(call, header, prefilled=span, span=span)
    s, e = part if part is not None else (0, x.size)
    inputs = [g.data(r, step, span, wd, span)[s:e] for r in range(g.n)]
    if out.dtype == wd:
        _fold(out, inputs, op, mean)
    else:
        acc = g.scratch("fold", wd, e - s)
        _fold(acc, inputs, op, mean)
        np.copyto(out, acc, casting="unsafe")


def fold_from_peers(g: EngineGroup, x: np.ndarray, target: np.ndarray, wd: np.dtype,
                    op: ReduceOp, mean: int | None, extras: list[tuple[int, int, int]],
                    s: int, e: int) -> None:
    """``target`` (``e - s`` items) = the rank-order fold of every rank's ``x[s:e]``, read piece
    by piece from the peers' memory (``extras``: their input addresses). ``target`` may be
    ``x[s:e]`` itself (an in-place allreduce): this rank's piece is then copied first."""
    per = max(1, PIECE_BYTES // max(x.itemsize, wd.itemsize))
    count = min(per, e - s)
    aliased = np.may_share_memory(x, target)
    bufs = [g.scratch(f"piece{r}", x.dtype, count) for r in range(g.n)]
    convert = wd != x.dtype
    conv = [g.scratch(f"conv{r}", wd, count) for r in range(g.n)] if convert else None
    acc = g.scratch("acc", wd, count) if wd != target.dtype else None
    for ps in range(s, e, per):
        pe = min(e, ps + per)
        k = pe - ps
        inputs = []
        for r in range(g.n):
            if r != g.me:
                piece = bufs[r][:k]
                g.read(r, extras[r][1] + ps * x.itemsize, piece)
            elif aliased and not convert:
                piece = bufs[r][:k]
                piece[...] = x[ps:pe]
            else:
                piece = x[ps:pe]
            if conv is not None:
                np.copyto(conv[r][:k], piece, casting="unsafe")
                piece = conv[r][:k]
            inputs.append(piece)
        dest = target[ps - s:pe - s]
        if acc is None:
            _fold(dest, inputs, op, mean)
        else:
            _fold(acc[:k], inputs, op, mean)
            np.copyto(dest, acc[:k], casting="unsafe")


def _fold(out: np.ndarray, inputs: list[np.ndarray], op: ReduceOp, mean: int | None) -> None:
    """``ops.fold`` without its checks: every view here is built with out's dtype and length."""
    _reduce.fold(out, inputs, OPS[op].kernel, float(mean or 0))


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
        worker = _state.state(cross)
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
                        execute(PREPARE["reduce_scatter"](whole, node, stage_op, timeout, None,
                                                          part, node_seq[step, p]))
                        whole = dst[a:b] if direct else whole
                    else:
                        execute(prepare(whole, node, stage_op, timeout, None, whole,
                                        node_seq[step, p]))
                        me = node.rank * chunk
                        part = whole[me:me + chunk].copy()
                    parts[p] = (whole, part)
                    pending[p] = worker.submit(functools.partial(across, p, part, execute))
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


__all__ = ["IMPLEMENTATIONS", "engine_allreduce", "fold_from_peers", "fold_plan",
           "fold_through_slots", "prepare", "stages"]
