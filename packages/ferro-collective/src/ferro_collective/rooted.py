"""The rooted collectives: reduce, gather, scatter (checks, plans, algorithms, engine paths).

Algorithms (on flat contiguous 1-d buffers; ``v = (rank - root) mod n`` is a rank's place in the
tree):

- ``tree`` (binomial): ceil(log2 n) rounds. In reduce and gather, rank ``v`` collects from its
  children ``v + 2^k`` (for every ``2^k`` below its lowest set bit) and sends to its parent
  ``v - lowbit(v)``; a subtree covers the contiguous ranks ``[v, v + span)``. Scatter runs the same
  tree downwards. Reductions fold a child's partial result into the parent's (the lower ranks'
  operand first), so the combination order is fixed by ``n`` and ``root``: the root's result is
  the same bits run after run.
- ``ring`` (reduce, large messages): the ring reduce-scatter of :mod:`.p2p`, then every rank
  sends its reduced chunk to the root (bandwidth-optimal).
- ``star`` (gather/scatter, large blocks): the root receives from / sends to every rank directly.

``auto`` picks by message size (:func:`.plan.choose`). On the same-host engine reduce and
gather run through the engine's door (``ferro/engine.h``: a step per slot of data, the root
folding every rank's slot in rank order, the fold of ``algorithm="star"``, or copying it), and
scatter after its metadata step (the root's blocks ride in it when small; else every rank
reads its block from the root's memory), from C in its common case (:mod:`._metacall`).
"""

from __future__ import annotations

import numpy as np

from ferro_backend import Backend
from ferro_backend.partition import split_bounds

from . import _onecall, gathered, pair
from .all_gather import door_bytes
from .arguments import as_array, check_backend, check_out, check_out_known, check_root, finish
from .engine_group import EngineGroup, Step, door_calls
from .metadata_sizes import scatter_block
from .metadata_step import MetaPlan, get_pieces, guard, pack_desc, put_pieces
from .ops import CODES, OPS, ReduceOp, accumulate, as_op, work_dtype
from .p2p import Ctx, reduce_scatter_ring_into
from .plan import Collective, Plan, choose, gathered_or_first


def _children(v: int, n: int) -> tuple[list[int], int]:
    """The binomial tree's children of relative rank ``v`` (ascending), and ``v``'s span (its
    subtree is ranks ``[v, v + span)``)."""
    kids, mask = [], 1
    while mask < n and not v & mask:
        if v + mask < n:
            kids.append(v + mask)
        mask <<= 1
    return kids, min(mask, n - v)


def _span(c: int, n: int) -> int:
    return min(c & -c, n - c)


# ----------------------------------------------------------------------------- algorithms
def reduce_tree(ctx: Ctx, buf: np.ndarray, op: ReduceOp, root: int) -> bool:
    """Binomial-tree reduce in place; True on the root (``buf`` holds the result)."""
    n = ctx.n
    v = (ctx.rank - root) % n
    kids, _ = _children(v, n)
    tag = ctx.next_tag()
    parts = [ctx.take(buf.size, buf.dtype).reshape(buf.shape) for _ in kids]
    reqs = [ctx.irecv(p, (c + root) % n, tag) for p, c in zip(parts, kids)]
    for i, (c, p, req) in enumerate(zip(kids, parts, reqs)):
        ctx.wait(req, (c + root) % n, f"the partial result of its subtree (tree rank {c})")
        last = v == 0 and i == len(kids) - 1
        accumulate(buf, p, op, n if op is ReduceOp.MEAN and last else None)
    if v:
        ctx.send(buf, (v - (v & -v) + root) % n, tag)
        return False
    return True


def reduce_ring(ctx: Ctx, buf: np.ndarray, op: ReduceOp, root: int) -> bool:
    """Ring reduce-scatter, then every chunk to the root; True on the root."""
    n, me = ctx.n, ctx.rank
    bounds = split_bounds(buf.size, n)
    reduce_scatter_ring_into(ctx, buf, op, bounds, n if op is ReduceOp.MEAN else None)
    tag = ctx.next_tag()
    if me != root:
        s, e = bounds[me]
        if e > s:
            ctx.send(buf[s:e], root, tag)
        return False
    reqs = {r: ctx.irecv(buf[s:e], r, tag) for r, (s, e) in enumerate(bounds)
            if r != root and e > s}
    for r, req in reqs.items():
        ctx.wait(req, r, f"its reduced chunk {r}")
    return True


def gather_tree(ctx: Ctx, block: np.ndarray, out: np.ndarray | None, root: int) -> None:
    """Binomial-tree gather of equal byte blocks; the root's ``out`` gets them in rank order."""
    n, size = ctx.n, block.size
    v = (ctx.rank - root) % n
    kids, span = _children(v, n)
    tag = ctx.next_tag()
    if v == 0 and root == 0:
        buf = out
    else:
        buf = block if not kids else ctx.take(span * size, np.uint8)
    if buf is not block:
        buf[:size] = block
    reqs = [(c, ctx.irecv(buf[(c - v) * size:(c - v + _span(c, n)) * size], (c + root) % n, tag))
            for c in kids]
    for c, req in reqs:
        ctx.wait(req, (c + root) % n, f"the blocks of tree ranks {c}..{c + _span(c, n) - 1}")
    if v:
        ctx.send(buf, (v - (v & -v) + root) % n, tag)
    elif root:  # tree order is rank order rotated by the root
        cut = (n - root) * size
        out[root * size:] = buf[:cut]
        out[:root * size] = buf[cut:]


def gather_star(ctx: Ctx, block: np.ndarray, out: np.ndarray | None, root: int) -> None:
    size, tag = block.size, ctx.next_tag()
    if ctx.rank != root:
        ctx.send(block, root, tag)
        return
    out[root * size:(root + 1) * size] = block
    reqs = [(r, ctx.irecv(out[r * size:(r + 1) * size], r, tag)) for r in range(ctx.n)
            if r != root]
    for r, req in reqs:
        ctx.wait(req, r, "its block")


def scatter_tree(ctx: Ctx, data: np.ndarray | None, mine: np.ndarray, root: int) -> None:
    """Binomial-tree scatter of equal byte blocks: ``mine`` gets block ``rank`` of the root's
    ``data`` (rank order)."""
    n, size = ctx.n, mine.size
    v = (ctx.rank - root) % n
    kids, span = _children(v, n)
    tag = ctx.next_tag()
    if v == 0:
        buf = data if root == 0 else np.concatenate([data[root * size:], data[:root * size]])
    else:
        buf = mine if not kids else ctx.take(span * size, np.uint8)
        parent = (v - (v & -v) + root) % n
        ctx.wait(ctx.irecv(buf, parent, tag), parent, "its blocks")
    for c in reversed(kids):  # the largest subtree first: it has the most rounds ahead
        ctx.send(buf[(c - v) * size:(c - v + _span(c, n)) * size], (c + root) % n, tag)
    if buf is not mine:
        mine[...] = buf[:size]


def scatter_star(ctx: Ctx, data: np.ndarray | None, mine: np.ndarray, root: int) -> None:
    size, tag = mine.size, ctx.next_tag()
    if ctx.rank != root:
        ctx.wait(ctx.irecv(mine, root, tag), root, "its block")
        return
    for r in range(ctx.n):
        if r != root:
            ctx.send(data[r * size:(r + 1) * size], r, tag)
    mine[...] = data[root * size:(root + 1) * size]


# ----------------------------------------------------------------------------- reduce
def prepare_reduce(tensor, backend: Backend, arg, timeout, algorithm, out,
                   seq: int | None = None) -> Plan:
    """The checked plan of one reduce (``arg``: ``(root, op)``)."""
    root, op = arg
    x = as_array("reduce", tensor, backend)
    n = backend.world_size
    root = check_root("reduce", root, n)
    op = as_op(op)
    wd = work_dtype("reduce", x.dtype, op)
    algo = choose(REDUCE, algorithm, x.size * wd.itemsize, n)
    out = check_out("reduce", out, x.shape, x.dtype) if backend.rank == root else None

    def python(ctx: Ctx) -> np.ndarray | None:
        if out is not None and wd == x.dtype and not np.may_share_memory(out, x):
            buf = out.reshape(-1)
            buf[...] = x.reshape(-1)
        else:
            buf = np.array(x, dtype=wd, order="C", copy=True).reshape(-1)
        if n > 1 and buf.size:
            fn = reduce_tree if algo == "tree" else reduce_ring
            if not fn(ctx, buf, op, root):
                return None
        elif ctx.rank != root:
            return None
        return finish(buf.reshape(x.shape), x.dtype, out)

    def engine(group: EngineGroup, call: Step, header: bytes) -> np.ndarray | None:
        result = (np.empty(x.shape, x.dtype) if out is None else out) if group.me == root \
            else None
        group.door(call, door_calls.REDUCE, np.ascontiguousarray(x), result, CODES[x.dtype],
                   OPS[op].door, root, shape=x.shape)
        return result

    def two(ctx: Ctx, header: bytes) -> np.ndarray | None:
        return pair.reduce(ctx, header, x, wd, op, out, root)

    def many(ctx: Ctx, header: bytes) -> np.ndarray | None:
        return gathered.allreduce(ctx, header, x, wd, op, out, root)

    nbytes = x.size * wd.itemsize
    return Plan("reduce", backend, timeout, (x.dtype, x.shape, op, root), python, engine,
                algorithm=algorithm, seq=seq,
                pair=(two if nbytes <= pair.FUSE_MAX else None) if n == 2 else
                gathered_or_first("allreduce", nbytes, n, backend, many, python))


# ----------------------------------------------------------------------------- gather
def prepare_gather(tensor, backend: Backend, root, timeout, algorithm, out,
                   seq: int | None = None) -> Plan:
    """The checked plan of one gather (``arg``: the root)."""
    x = as_array("gather", tensor, backend)
    n = backend.world_size
    root = check_root("gather", root, n)
    algo = choose(GATHER, algorithm, x.nbytes, n)
    shape = (n,) if x.ndim == 0 else (x.shape[0] * n, *x.shape[1:])
    mine = backend.rank == root
    out = check_out("gather", out, shape, x.dtype) if mine else None

    def result() -> np.ndarray:
        return np.empty(shape, x.dtype) if out is None else out

    def python(ctx: Ctx) -> np.ndarray | None:
        block = np.ascontiguousarray(x).reshape(-1)
        res = result() if mine else None
        if n == 1 or not block.size:
            if mine:
                res.reshape(-1)[...] = np.tile(block, n)
            return res
        flat = res.reshape(-1).view(np.uint8) if mine else None
        {"tree": gather_tree, "star": gather_star}[algo](ctx, block.view(np.uint8), flat, root)
        return res

    def engine(group: EngineGroup, call: Step, header: bytes) -> np.ndarray | None:
        res = result() if mine else None
        door_bytes(group, call, door_calls.GATHER, x, res, root)
        return res

    def two(ctx: Ctx, header: bytes) -> np.ndarray | None:  # (or more: :mod:`.gathered`)
        block = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
        if n > 2:
            return gathered.all_gather(ctx, header, block, result() if mine else None)
        return pair.gather(ctx, header, block, result() if mine else None, root)

    return Plan("gather", backend, timeout, (x.dtype, x.shape, None, root), python, engine,
                algorithm=algorithm, seq=seq,
                pair=(two if 0 < x.nbytes <= pair.FUSE_MAX else None) if n == 2 else
                gathered_or_first("all_gather", x.nbytes, n, backend, two, python))


# ----------------------------------------------------------------------------- scatter
def prepare_scatter(tensor, backend: Backend, root, timeout, algorithm, out,
                    seq: int | None = None) -> MetaPlan:
    """The checked plan of one scatter (``arg``: the root); a :class:`MetaPlan`: only the root
    knows the dtype and shape, which reach every rank in its metadata round."""
    check_backend("scatter", backend)
    n, me = backend.world_size, backend.rank
    root = check_root("scatter", root, n)
    if out is not None and not isinstance(out, np.ndarray):
        raise TypeError(f"scatter: out must be a numpy array, got {type(out).__name__}")

    def prepare() -> np.ndarray:
        if tensor is None:
            raise ValueError(f"scatter: the root (rank {root}) must pass an array, got None")
        x = as_array("scatter", tensor, backend)
        try:
            desc = pack_desc(x)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"scatter: {exc}") from None
        _check_root_out(out, x, n)
        return x, desc

    choose(SCATTER, algorithm, 0, n)  # an unknown algorithm is refused now
    x, meta, invalid = None, pack_desc(None), None
    if me == root:
        prepared, invalid = guard(prepare)
        if prepared is not None:
            x, meta = prepared
    elif out is not None:  # (its shape and dtype: once the root's metadata is in)
        _, invalid = guard(lambda: check_out_known("scatter", out, None, None))

    data = np.ascontiguousarray(x).reshape(-1).view(np.uint8) if x is not None else None

    def plan(metas: list[bytes]) -> tuple[np.ndarray, np.ndarray, BaseException | None]:
        """The result array, its bytes, and this rank's late ``out`` error (or the error every
        rank raises alike, from the root's shape)."""
        dtype, shape = scatter_block(metas[root], root, n)
        res, late = out, None
        if out is not None:  # checked now that the shape is known; a bad one still takes part
            _, late = guard(lambda: check_out("scatter", out, shape, dtype))
        if res is None or late is not None:
            res = np.empty(shape, dtype)
        return res, res.reshape(-1).view(np.uint8), late

    def body(ctx: Ctx, metas: list[bytes]) -> np.ndarray:
        res, mine, late = plan(metas)
        if n == 1 or not mine.size:
            if me == root:
                mine[...] = data[:mine.size]
        else:
            algo = choose(SCATTER, algorithm, mine.size, n)
            {"tree": scatter_tree, "star": scatter_star}[algo](ctx, data, mine, root)
        if late is not None:
            raise late
        return res

    def put(group: EngineGroup, payload: np.ndarray) -> None:
        if me == root:
            size = data.size // n
            put_pieces(group, payload, [data[r * size:(r + 1) * size]
                                                 for r in range(n)],
                                data, [r * size for r in range(n)])

    def run(group: EngineGroup, call: Step, step: int, off: int, metas: list[bytes],
            messages) -> np.ndarray:
        """scatter on the same-host engine: the root's blocks ride in the metadata step when
        small, else every rank reads its block straight from the root's memory."""
        res, mine, late = plan(metas)
        size = mine.size
        totals, starts, recvs = [0] * n, [0] * n, [None] * n
        # the root's block for itself stays home: ours is block me, or me - 1 past the root
        totals[root], starts[root], recvs[root] = (n - 1) * size, (me - (me > root)) * size, mine
        own = data[me * size:(me + 1) * size] if me == root else None
        if not get_pieces(group, call, step, off, totals, starts, recvs, own,
                                   own_last=out is not None and own is not None
                                   and np.may_share_memory(res, data)):
            return messages()
        if late is not None:
            raise late
        return res

    return MetaPlan("scatter", backend, timeout, (None, (), None, root), meta, body, invalid,
                    (put, run), algorithm)


def _check_root_out(out, x: np.ndarray, n: int) -> None:
    """The root's ``out=`` checked against its block (where ``x`` splits into ``n``: else
    every rank raises alike, from its metadata)."""
    if out is not None and x.ndim and x.shape[0] % n == 0:
        check_out("scatter", out, (x.shape[0] // n, *x.shape[1:]), x.dtype)


def scatter_path(tensor, backend, root, out) -> str | None:
    """The ``algorithm`` a scatter runs with: None (its one-call path may take it), or
    ``"auto"`` (the general path) where its prepare step refuses ``out=``: the one-call path
    checks ``out=`` only once the data moved. (None without ``out=``.)"""
    if out is None:
        return None
    try:
        if backend.rank == root:
            _check_root_out(out, np.asarray(tensor), backend.world_size)
        else:
            check_out_known("scatter", out, None, None)
    except Exception:  # (a bad root or tensor too: the general path says what)
        return "auto"
    return None


REDUCE = Collective("reduce", prepare_reduce, None, ("auto", "tree", "ring"), torch="reduce",
                    jax="reduce")
GATHER = Collective("gather", prepare_gather, _onecall.GATHER, ("auto", "tree", "star"),
                    torch="gather")
SCATTER = Collective("scatter", prepare_scatter, _onecall.SCATTER, ("auto", "tree", "star"),
                     torch="scatter")

__all__ = ["GATHER", "REDUCE", "SCATTER", "gather_star", "gather_tree", "prepare_gather",
           "prepare_reduce", "prepare_scatter", "reduce_ring", "reduce_tree", "scatter_path",
           "scatter_star", "scatter_tree"]
