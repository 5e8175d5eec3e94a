"""The rooted collectives: reduce, gather, scatter, and their async forms.

Algorithms (on flat contiguous 1-d buffers; ``v = (rank - root) mod n`` is a rank's place in the
tree):

- ``tree`` (binomial): ceil(log2 n) rounds. In reduce and gather, rank ``v`` collects from its
  children ``v + 2^k`` (for every ``2^k`` below its lowest set bit) and sends to its parent
  ``v - lowbit(v)``; a subtree covers the contiguous ranks ``[v, v + span)``. Scatter runs the same
  tree downwards. Reductions fold a child's partial result into the parent's (the lower ranks'
  operand first), so the combination order is fixed by ``n`` and ``root``: the root's result is
  the same bits run after run.
- ``ring`` (reduce, large messages): the ring reduce-scatter of :mod:`.algorithms`, then every
  rank sends its reduced chunk to the root (bandwidth-optimal).
- ``star`` (gather/scatter, large blocks): the root receives from / sends to every rank directly.

``auto`` picks by message size (:func:`.call.choose`). Over a ``ShmBackend`` reduce and gather
run on the same-host engine (:mod:`.fastpath`: the rank-order fold of ``algorithm="star"``, read
straight from the peers' memory when large), and so does scatter (the root's blocks ride in its
metadata step when small; else every rank reads its block from the root's memory).
"""

from __future__ import annotations

import os

import numpy as np

from ferro_backend import Backend, InvalidRankError, SizeMismatchError

from . import algorithms as alg
from . import fastpath
from .call import Call, as_array, check_out, choose
from .engine_group import EngineGroup, Step
from .metadata import MetaCall, guard, pack_desc, unpack_desc
from .ops import ReduceOp, accumulate, as_op, work_dtype
from .work import Work


def check_root(name: str, root, n: int) -> int:
    if isinstance(root, bool) or not isinstance(root, int | np.integer) or not 0 <= root < n:
        raise InvalidRankError(f"{name}: root {root!r} is out of range for world_size {n}")
    return int(root)


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
def reduce_tree(ctx: alg.Ctx, buf: np.ndarray, op: ReduceOp, root: int) -> bool:
    """Binomial-tree reduce in place; True on the root (``buf`` holds the result)."""
    n = ctx.n
    v = (ctx.rank - root) % n
    kids, _ = _children(v, n)
    tag = ctx.next_tag()
    parts = [np.empty_like(buf) for _ in kids]
    reqs = [ctx.irecv(p, (c + root) % n, tag) for p, c in zip(parts, kids)]
    for i, (c, p, req) in enumerate(zip(kids, parts, reqs)):
        ctx.wait(req, (c + root) % n, f"the partial result of its subtree (tree rank {c})")
        last = v == 0 and i == len(kids) - 1
        accumulate(buf, p, op, n if op is ReduceOp.MEAN and last else None)
    if v:
        ctx.send(buf, (v - (v & -v) + root) % n, tag)
        return False
    return True


def reduce_ring(ctx: alg.Ctx, buf: np.ndarray, op: ReduceOp, root: int) -> bool:
    """Ring reduce-scatter, then every chunk to the root; True on the root."""
    n, me = ctx.n, ctx.rank
    bounds = alg.chunk_bounds(buf.size, n)
    alg.reduce_scatter_ring_into(ctx, buf, op, bounds, n if op is ReduceOp.MEAN else None)
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


def gather_tree(ctx: alg.Ctx, block: np.ndarray, out: np.ndarray | None, root: int) -> None:
    """Binomial-tree gather of equal byte blocks; the root's ``out`` gets them in rank order."""
    n, size = ctx.n, block.size
    v = (ctx.rank - root) % n
    kids, span = _children(v, n)
    tag = ctx.next_tag()
    if v == 0 and root == 0:
        buf = out
    else:
        buf = block if not kids else np.empty(span * size, np.uint8)
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


def gather_star(ctx: alg.Ctx, block: np.ndarray, out: np.ndarray | None, root: int) -> None:
    size, tag = block.size, ctx.next_tag()
    if ctx.rank != root:
        ctx.send(block, root, tag)
        return
    out[root * size:(root + 1) * size] = block
    reqs = [(r, ctx.irecv(out[r * size:(r + 1) * size], r, tag)) for r in range(ctx.n)
            if r != root]
    for r, req in reqs:
        ctx.wait(req, r, "its block")


def scatter_tree(ctx: alg.Ctx, data: np.ndarray | None, mine: np.ndarray, root: int) -> None:
    """Binomial-tree scatter of equal byte blocks: ``mine`` gets block ``rank`` of the root's
    ``data`` (rank order)."""
    n, size = ctx.n, mine.size
    v = (ctx.rank - root) % n
    kids, span = _children(v, n)
    tag = ctx.next_tag()
    if v == 0:
        buf = data if root == 0 else np.concatenate([data[root * size:], data[:root * size]])
    else:
        buf = mine if not kids else np.empty(span * size, np.uint8)
        parent = (v - (v & -v) + root) % n
        ctx.wait(ctx.irecv(buf, parent, tag), parent, "its blocks")
    for c in reversed(kids):  # the largest subtree first: it has the most rounds ahead
        ctx.send(buf[(c - v) * size:(c - v + _span(c, n)) * size], (c + root) % n, tag)
    if buf is not mine:
        mine[...] = buf[:size]


def scatter_star(ctx: alg.Ctx, data: np.ndarray | None, mine: np.ndarray, root: int) -> None:
    size, tag = mine.size, ctx.next_tag()
    if ctx.rank != root:
        ctx.wait(ctx.irecv(mine, root, tag), root, "its block")
        return
    for r in range(ctx.n):
        if r != root:
            ctx.send(data[r * size:(r + 1) * size], r, tag)
    mine[...] = data[root * size:(root + 1) * size]


# ----------------------------------------------------------------------------- engine paths
def _gather_engine(g: EngineGroup, call: Step, header: bytes, block: np.ndarray,
                   out: np.ndarray | None, root: int) -> None:
    """gather on the same-host engine: slots when small, else the root reads every block
    straight from its owner's memory (or, without cross-memory reads, slot-sized pieces)."""
    size = block.size
    if size <= g.slot_bytes:
        step = g.exchange(call, header, block)
        if g.me == root:
            for r in range(g.n):
                out[r * size:(r + 1) * size] = block if r == root else g.data(r, step, size,
                                                                              block.dtype)
    elif g.cma_ok:
        step = g.exchange(call, header, extra=(os.getpid(), block.ctypes.data, 0))
        if g.me == root:
            extras = g.extras(step)
            for r in range(g.n):
                if r == root:
                    out[r * size:(r + 1) * size] = block
                else:
                    g.read(r, extras[r][1], out[r * size:(r + 1) * size])
        g.sync(call)  # nobody's block is read any more
    else:
        for s in range(0, size, g.slot_bytes):
            e = min(size, s + g.slot_bytes)
            piece = g.scratch("gather", np.dtype(np.uint8), g.n * (e - s)) if g.me == root \
                else None
            _gather_engine(g, call, header, block[s:e], piece, root)
            if piece is not None:
                out.reshape(g.n, size)[:, s:e] = piece.reshape(g.n, e - s)


# ----------------------------------------------------------------------------- reduce
def _reduce(tensor, backend: Backend, root, op, timeout, out, algorithm=None) -> Call:
    x = as_array("reduce", tensor, backend)
    n = backend.world_size
    root = check_root("reduce", root, n)
    op = as_op(op)
    wd = work_dtype("reduce", x.dtype, op)
    algo = choose("reduce", algorithm, x.size * wd.itemsize, n)
    out = check_out("reduce", out, x.shape, x.dtype) if backend.rank == root else None

    def body(ctx: alg.Ctx) -> np.ndarray | None:
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
        return _finish(buf.reshape(x.shape), x.dtype, out)

    def fast(group, step, header: bytes) -> np.ndarray | None:
        mine = group.backend.rank == root
        result = (np.empty(x.shape, x.dtype) if out is None else out) if mine else \
            group.scratch("reduce", x.dtype, x.size).reshape(x.shape)
        fastpath.allreduce(group, step, header, np.ascontiguousarray(x).reshape(-1),
                           result.reshape(-1), wd, op)
        return result if mine else None

    return Call("reduce", backend, timeout, (x.dtype, x.shape, op, root), body, fast, algorithm)


def _finish(result: np.ndarray, dtype: np.dtype, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return result if result.dtype == dtype else result.astype(dtype)
    if not np.may_share_memory(result, out):
        np.copyto(out, result, casting="unsafe")
    return out


def reduce(tensor, backend: Backend, root: int = 0, op: ReduceOp = ReduceOp.SUM, *,
           timeout: float | None = None, out: np.ndarray | None = None) -> np.ndarray | None:
    """Reduce ``tensor`` element-wise across all ranks; only ``root`` gets the result.

    Parameters
    ----------
    tensor : array_like
        This rank's contribution; every rank passes the same shape and dtype. Not modified.
    backend : ferro_backend.Backend
    root : int
        The rank that receives the result.
    op : ReduceOp
        As for :func:`allreduce`: SUM, MEAN (floats), MAX, MIN, PRODUCT, BAND/BOR/BXOR
        (integers and bool).
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: ``backend.timeout``).
    out : numpy.ndarray, optional
        On the root: a writable C-contiguous array of the input's shape and dtype to fill and
        return (it may be the input). Ignored on the other ranks.

    Returns
    -------
    numpy.ndarray or None
        The reduction on ``root`` (the same bits run after run: the binomial tree, or the ring
        for large messages, fixes the combination order), None on the other ranks.

    Raises
    ------
    InvalidRankError
        ``root`` is not in ``[0, world_size)``.
    TypeError
        An unsupported dtype for ``op``.
    CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for every collective.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> run_ranks(lambda b: reduce(np.array([b.rank + 1]), b, root=1), 3)
    [None, array([6]), None]
    """
    return _reduce(tensor, backend, root, op, timeout, out).run()


def reduce_async(tensor, backend: Backend, root: int = 0, op: ReduceOp = ReduceOp.SUM, *,
                 timeout: float | None = None, out: np.ndarray | None = None) -> Work:
    """:func:`reduce` in the background; ``Work.wait()`` returns its result (None off root)."""
    return _reduce(tensor, backend, root, op, timeout, out).submit()


# ----------------------------------------------------------------------------- gather
def _gather(tensor, backend: Backend, root, timeout, out, algorithm=None) -> Call:
    x = as_array("gather", tensor, backend)
    n = backend.world_size
    root = check_root("gather", root, n)
    algo = choose("gather", algorithm, x.nbytes, n)
    shape = (n,) if x.ndim == 0 else (x.shape[0] * n, *x.shape[1:])
    mine = backend.rank == root
    out = check_out("gather", out, shape, x.dtype) if mine else None

    def result() -> np.ndarray:
        return np.empty(shape, x.dtype) if out is None else out

    def body(ctx: alg.Ctx) -> np.ndarray | None:
        block = np.ascontiguousarray(x).reshape(-1)
        res = result() if mine else None
        if n == 1 or not block.size:
            if mine:
                res.reshape(-1)[...] = np.tile(block, n)
            return res
        flat = res.reshape(-1).view(np.uint8) if mine else None
        {"tree": gather_tree, "star": gather_star}[algo](ctx, block.view(np.uint8), flat, root)
        return res

    def fast(group, step, header: bytes) -> np.ndarray | None:
        block = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
        res = result() if mine else None
        _gather_engine(group, step, header, block,
                       res.reshape(-1).view(np.uint8) if mine else None, root)
        return res

    return Call("gather", backend, timeout, (x.dtype, x.shape, None, root), body, fast,
                algorithm)


def gather(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
           out: np.ndarray | None = None) -> np.ndarray | None:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order, on ``root`` only.

    Every rank passes the same shape and dtype (else CollectiveMismatchError on every rank). A
    0-d input gathers to shape ``[world_size]``. ``out=``: on the root, a writable C-contiguous
    array of the result's shape and dtype to fill (ignored elsewhere). Binomial tree for small
    blocks, direct sends to the root for large ones; the engine on a ``ShmBackend``.

    Returns the gathered array on ``root``, None on the other ranks. Raises
    :class:`InvalidRankError` for a root outside ``[0, world_size)``.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> run_ranks(lambda b: gather(np.array([b.rank, 10 * b.rank]), b), 2)
    [array([ 0,  0,  1, 10]), None]
    """
    return _gather(tensor, backend, root, timeout, out).run()


def gather_async(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
                 out: np.ndarray | None = None) -> Work:
    """:func:`gather` in the background."""
    return _gather(tensor, backend, root, timeout, out).submit()


# ----------------------------------------------------------------------------- scatter
def _scatter(tensor, backend: Backend, root, timeout, out, algorithm=None) -> Call:
    if not isinstance(backend, Backend):
        as_array("scatter", 0, backend)  # the TypeError naming the backend
    n, me = backend.world_size, backend.rank
    root = check_root("scatter", root, n)
    if out is not None and not isinstance(out, np.ndarray):
        raise TypeError(f"scatter: out must be a numpy array, got {type(out).__name__}")

    def prepare() -> np.ndarray:
        if tensor is None:
            raise ValueError(f"scatter: the root (rank {root}) must pass an array, got None")
        x = as_array("scatter", tensor, backend)
        try:
            return x, pack_desc(x)
        except ValueError as exc:
            raise ValueError(f"scatter: {exc}") from None

    choose("scatter", algorithm, 0, n)  # an unknown algorithm is refused now
    x, meta, invalid = None, pack_desc(None), None
    if me == root:
        prepared, invalid = guard(prepare)
        if prepared is not None:
            x, meta = prepared

    data = np.ascontiguousarray(x).reshape(-1).view(np.uint8) if x is not None else None

    def plan(metas: list[bytes]) -> tuple[np.ndarray, np.ndarray, BaseException | None]:
        """The result array, its bytes, and this rank's late ``out`` error (or the error every
        rank raises alike, from the root's shape)."""
        dtype, full = unpack_desc(metas[root])
        if len(full) == 0:
            raise SizeMismatchError(f"scatter: root {root}'s tensor is 0-d; it cannot be split "
                                    "across ranks")
        if full[0] % n:
            raise SizeMismatchError(f"scatter: dim 0 of root {root}'s shape {full} ({full[0]}) "
                                    f"is not divisible by world_size {n}")
        shape = (full[0] // n, *full[1:])
        res, late = out, None
        if out is not None:  # checked now that the shape is known; a bad one still takes part
            _, late = guard(lambda: check_out("scatter", out, shape, dtype))
        if res is None or late is not None:
            res = np.empty(shape, dtype)
        return res, res.reshape(-1).view(np.uint8), late

    def body(ctx: alg.Ctx, metas: list[bytes]) -> np.ndarray:
        res, mine, late = plan(metas)
        if n == 1 or not mine.size:
            if me == root:
                mine[...] = data[:mine.size]
        else:
            algo = choose("scatter", algorithm, mine.size, n)
            {"tree": scatter_tree, "star": scatter_star}[algo](ctx, data, mine, root)
        if late is not None:
            raise late
        return res

    def put(group: EngineGroup, payload: np.ndarray) -> None:
        if me == root:
            size = data.size // n
            fastpath.put_pieces(group, payload, [data[r * size:(r + 1) * size]
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
        if not fastpath.get_pieces(group, call, step, off, totals, starts, recvs, own,
                                   own_last=out is not None and own is not None
                                   and np.may_share_memory(res, data)):
            return messages()
        if late is not None:
            raise late
        return res

    return MetaCall("scatter", backend, timeout, (None, (), None, root), meta, body, invalid,
                    (put, run), algorithm)


def scatter(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
            out: np.ndarray | None = None) -> np.ndarray:
    """Split ``root``'s ``tensor`` along dim 0 into ``world_size`` equal chunks; rank ``r``
    returns chunk ``r`` (a new array, or ``out``).

    Parameters
    ----------
    tensor : array_like or None
        On ``root``: the array to split (dim 0 divisible by the world size, as for
        :func:`reduce_scatter`). The other ranks pass None (anything they pass is ignored).
    backend : ferro_backend.Backend
    root : int
    timeout : float, optional
    out : numpy.ndarray, optional
        A writable C-contiguous array of the chunk's shape and dtype to fill and return.

    Raises
    ------
    InvalidRankError
        ``root`` is not in ``[0, world_size)``.
    SizeMismatchError (a ValueError)
        Dim 0 of the root's tensor is not divisible by the world size, or it is 0-d: on every
        rank (the root's shape reaches every rank first). ``out`` of the wrong shape or dtype:
        on that rank, after the call.
    CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for every collective; the root passing None is an error on the root and a
        CollectiveMismatchError on the others.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> run_ranks(lambda b: scatter(np.arange(4) if b.rank == 0 else None, b), 2)
    [array([0, 1]), array([2, 3])]
    """
    return _scatter(tensor, backend, root, timeout, out).run()


def scatter_async(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
                  out: np.ndarray | None = None) -> Work:
    """:func:`scatter` in the background."""
    return _scatter(tensor, backend, root, timeout, out).submit()


__all__ = ["gather", "gather_async", "reduce", "reduce_async", "scatter", "scatter_async"]
