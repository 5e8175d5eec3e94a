"""The collectives: allreduce, broadcast, all_gather, reduce_scatter, barrier, and their async forms.

All ranks of a backend must call the same collectives in the same order (as in torch.distributed).
Inputs are never modified; results are new arrays of the input's dtype, and every rank returns the
same bits. A rank that calls another collective, or the same one with another dtype, shape, op or
root, than its peers gets :class:`CollectiveMismatchError` on every rank, naming what each called.
"""

from __future__ import annotations

import numpy as np

from ferro_backend import DEFAULT_TIMEOUT, Backend, InvalidRankError, SizeMismatchError

from . import algorithms as alg
from . import fastpath, hierarchical
from .call import Call, as_array, check_out, choose, finish
from .engine_group import group_for
from .ops import ReduceOp, as_op, work_dtype
from .work import Work

DEFAULT_COLLECTIVE_TIMEOUT: float = DEFAULT_TIMEOUT
"""The default :attr:`Backend.timeout` (60 s). A collective's deadline is its backend's
``timeout`` (one source for p2p and collectives); a per-call ``timeout=`` wins."""

_SCALARS = (int, float, np.generic)  # bool is an int


def _scalar_array(tensor) -> np.ndarray | None:
    """A Python or numpy scalar as the 0-d array the general path would make of it (so that a
    scalar, e.g. a loss to average, takes the engine's one-call path too); None otherwise."""
    return np.asarray(tensor) if isinstance(tensor, _SCALARS) else None


# ----------------------------------------------------------------------------- allreduce
def _allreduce(tensor, backend: Backend, op, timeout, algorithm, out, *,
               seq: int | None = None) -> Call:
    x = as_array("allreduce", tensor, backend)
    op = as_op(op)
    wd = work_dtype("allreduce", x.dtype, op)
    n = backend.world_size
    algo = choose("allreduce", algorithm, x.nbytes, n, backend)
    out = check_out("allreduce", out, x.shape, x.dtype)

    def body(ctx: alg.Ctx) -> np.ndarray:
        if out is not None and wd == x.dtype:
            buf = out.reshape(-1)
            if not np.may_share_memory(out, x):
                buf[...] = x.reshape(-1)
        else:
            buf = np.array(x, dtype=wd, order="C", copy=True).reshape(-1)
        if n > 1 and buf.size:
            {"ring": alg.allreduce_ring, "recursive_doubling": alg.allreduce_recursive_doubling,
             "star": alg.allreduce_star}[algo](ctx, buf, op)
        return finish(buf.reshape(x.shape), x.dtype, out)

    def fast(group, step, header: bytes) -> np.ndarray:
        result = np.empty(x.shape, x.dtype) if out is None else out
        fastpath.allreduce(group, step, header, np.ascontiguousarray(x).reshape(-1),
                           result.reshape(-1), wd, op)
        return result

    header = (x.dtype, x.shape, op, -1)
    return Call("allreduce", backend, timeout, header, body, fast, algorithm, seq=seq,
                hier=lambda h: hierarchical.allreduce(h, x, op, wd, timeout, out))


def allreduce(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
              timeout: float | None = None, algorithm: str | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """Reduce ``tensor`` element-wise across all ranks; every rank gets the result.

    Parameters
    ----------
    tensor : array_like
        This rank's contribution (any shape; float16, bfloat16, float32, float64, int8..int64,
        uint8..uint64). Not modified.
    backend : ferro_backend.Backend
    op : ReduceOp
        SUM, MEAN (float dtypes only), MAX, MIN, PRODUCT, or BAND/BOR/BXOR (integer and bool
        dtypes only). Integer SUM is exact (wrapping like numpy); float16/bfloat16 accumulate in
        float32 and round once.
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: ``backend.timeout``).
    algorithm : {"auto", "ring", "recursive_doubling", "star"}
        "auto" picks recursive doubling for small messages and the ring for large ones, or the
        same-host engine where the backend has one (its results equal "star"'s bits). A forced
        algorithm must be the same on every rank.
    out : numpy.ndarray, optional
        A writable C-contiguous array of the input's shape and dtype to fill and return; it may
        be the input itself (an in-place allreduce).

    Returns
    -------
    numpy.ndarray
        ``out``, or a new array of the input's shape and dtype; bit-identical on every rank, and
        the same bits for the same inputs run after run.

    Raises
    ------
    TypeError
        An unsupported dtype, MEAN on integers, or a bitwise op on floats.
    CollectiveMismatchError
        Ranks called different collectives or shapes/dtypes/ops.
    CollectiveTimeoutError, PeerClosedError
        A peer did not arrive in time, or is gone.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> run_ranks(lambda b: allreduce(np.array([b.rank + 1.0]), b).tolist(), 3)
    [[6.0], [6.0], [6.0]]
    """
    x = tensor if type(tensor) is np.ndarray else _scalar_array(tensor)
    if algorithm is None and x is not None and type(op) is ReduceOp:
        group = group_for(backend)
        if group is not None:
            done = group.allreduce_now(x, out, op, timeout)
            if done is not None:
                return done
    return _allreduce(tensor, backend, op, timeout, algorithm, out).run()


def allreduce_async(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                    timeout: float | None = None, algorithm: str | None = None,
                    out: np.ndarray | None = None) -> Work:
    """:func:`allreduce` in the background; ``Work.wait()`` returns its result."""
    return _allreduce(tensor, backend, op, timeout, algorithm, out).submit()


# ----------------------------------------------------------------------------- broadcast
def _broadcast(tensor, backend: Backend, root: int, timeout, algorithm, out, *,
               seq: int | None = None) -> Call:
    x = as_array("broadcast", tensor, backend)
    n = backend.world_size
    if not isinstance(root, int | np.integer) or not 0 <= root < n:
        raise InvalidRankError(f"broadcast: root {root!r} is out of range for world_size {n}")
    root = int(root)
    algo = choose("broadcast", algorithm, x.nbytes, n, backend)
    out = check_out("broadcast", out, x.shape, x.dtype)

    def result() -> np.ndarray:
        buf = np.empty(x.shape, x.dtype) if out is None else out
        if not np.may_share_memory(buf, x):
            buf[...] = x
        return buf

    def body(ctx: alg.Ctx) -> np.ndarray:
        buf = result()
        flat = buf.reshape(-1).view(np.uint8) if buf.size else buf.reshape(-1)
        if n > 1 and buf.size:
            {"tree": alg.broadcast_tree, "star": alg.broadcast_star}[algo](ctx, flat, root)
        return buf

    def fast(group, step, header: bytes) -> np.ndarray:
        buf = result() if backend.rank == root else (np.empty(x.shape, x.dtype) if out is None
                                                      else out)
        fastpath.broadcast(group, step, header, buf.reshape(-1).view(np.uint8), root)
        return buf

    header = (x.dtype, x.shape, None, root)
    return Call("broadcast", backend, timeout, header, body, fast, algorithm, seq=seq,
                hier=lambda h: hierarchical.broadcast(h, x, root, timeout, out))


def broadcast(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
              algorithm: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Every rank returns a copy of ``root``'s ``tensor`` (all ranks pass the same shape/dtype).

    Uses a binomial tree (ceil(log2 n) rounds) by default, ``algorithm="star"`` for the seed's.
    Raises :class:`InvalidRankError` for a root outside ``[0, world_size)``. ``out=``: a
    writable C-contiguous array of the input's shape and dtype to fill (may be the input).
    """
    x = tensor if type(tensor) is np.ndarray else _scalar_array(tensor)
    if algorithm is None and x is not None and type(root) is int:
        group = group_for(backend)
        if group is not None:
            done = group.broadcast_now(x, out, root, timeout)
            if done is not None:
                return done
    return _broadcast(tensor, backend, root, timeout, algorithm, out).run()


def broadcast_async(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
                    algorithm: str | None = None, out: np.ndarray | None = None) -> Work:
    """:func:`broadcast` in the background."""
    return _broadcast(tensor, backend, root, timeout, algorithm, out).submit()


# ----------------------------------------------------------------------------- all_gather
def _all_gather(tensor, backend: Backend, timeout, algorithm, out, *,
                seq: int | None = None) -> Call:
    x = as_array("all_gather", tensor, backend)
    n = backend.world_size
    algo = choose("all_gather", algorithm, x.nbytes, n, backend)
    shape = (n,) if x.ndim == 0 else (x.shape[0] * n, *x.shape[1:])
    out = check_out("all_gather", out, shape, x.dtype)

    def body(ctx: alg.Ctx) -> np.ndarray:
        block = np.ascontiguousarray(x).reshape(-1)
        result = np.empty(shape, dtype=x.dtype) if out is None else out
        flat = result.reshape(-1)
        if n == 1 or not block.size:
            flat[...] = block
            return result
        b8, o8 = block.view(np.uint8), flat.view(np.uint8)
        {"ring": alg.all_gather_ring, "star": alg.all_gather_star}[algo](ctx, b8, o8)
        return result

    def fast(group, step, header: bytes) -> np.ndarray:
        result = np.empty(shape, dtype=x.dtype) if out is None else out
        block = np.ascontiguousarray(x).reshape(-1)
        fastpath.all_gather(group, step, header, block.view(np.uint8),
                            result.reshape(-1).view(np.uint8))
        return result

    header = (x.dtype, x.shape, None, -1)
    return Call("all_gather", backend, timeout, header, body, fast, algorithm, seq=seq,
                hier=lambda h: hierarchical.all_gather(h, x, shape, timeout, out))


def all_gather(tensor, backend: Backend, *, timeout: float | None = None,
               algorithm: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order.

    Every rank passes the same shape and dtype. The result's dim 0 is ``world_size`` times the
    input's; a 0-d input gathers to shape ``[world_size]``; zero-size inputs keep their shape
    (dim 0 multiplied). Ring algorithm by default (bandwidth-optimal), ``"star"`` for the seed's.
    """
    x = tensor if type(tensor) is np.ndarray else _scalar_array(tensor)
    if algorithm is None and x is not None:
        group = group_for(backend)
        if group is not None:
            done = group.all_gather_now(x, out, timeout)
            if done is not None:
                return done
    return _all_gather(tensor, backend, timeout, algorithm, out).run()


def all_gather_async(tensor, backend: Backend, *, timeout: float | None = None,
                     algorithm: str | None = None, out: np.ndarray | None = None) -> Work:
    """:func:`all_gather` in the background."""
    return _all_gather(tensor, backend, timeout, algorithm, out).submit()


# ----------------------------------------------------------------------------- reduce_scatter
def _reduce_scatter(tensor, backend: Backend, op, timeout, algorithm, out, *,
                    seq: int | None = None) -> Call:
    x = as_array("reduce_scatter", tensor, backend)
    op = as_op(op)
    wd = work_dtype("reduce_scatter", x.dtype, op)
    n = backend.world_size
    if x.ndim == 0:
        raise SizeMismatchError("reduce_scatter: a 0-d tensor cannot be split across ranks")
    if x.shape[0] % n:
        raise SizeMismatchError(f"reduce_scatter: dim 0 of shape {x.shape} ({x.shape[0]}) is "
                                f"not divisible by world_size {n}")
    algo = choose("reduce_scatter", algorithm, x.nbytes, n, backend)
    out_shape = (x.shape[0] // n, *x.shape[1:])
    out = check_out("reduce_scatter", out, out_shape, x.dtype)

    def body(ctx: alg.Ctx) -> np.ndarray:
        buf = np.array(x, dtype=wd, order="C", copy=True).reshape(-1)
        if n == 1 or not buf.size:
            mine = buf[: buf.size // n]
        else:
            mine = {"ring": alg.reduce_scatter_ring,
                    "star": alg.reduce_scatter_star}[algo](ctx, buf, op)
        if out is None:
            return np.array(mine, dtype=x.dtype, copy=True).reshape(out_shape)
        np.copyto(out.reshape(-1), mine, casting="unsafe")
        return out

    def fast(group, step, header: bytes) -> np.ndarray:
        result = np.empty(out_shape, x.dtype) if out is None else out
        fastpath.reduce_scatter(group, step, header, np.ascontiguousarray(x).reshape(-1),
                                result.reshape(-1), wd, op)
        return result

    header = (x.dtype, x.shape, op, -1)
    return Call("reduce_scatter", backend, timeout, header, body, fast, algorithm, seq=seq,
                hier=lambda h: hierarchical.reduce_scatter(h, x, op, wd, out_shape, timeout,
                                                           out, backend.rank))


def reduce_scatter(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                   timeout: float | None = None, algorithm: str | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
    """Reduce across ranks, then rank ``r`` keeps the ``r``-th of ``world_size`` equal slices
    along dim 0 (dim 0 must be divisible by the world size: else SizeMismatchError).
    ``out=``: a writable C-contiguous array of the slice's shape and dtype to fill."""
    if algorithm is None and type(tensor) is np.ndarray and type(op) is ReduceOp:
        group = group_for(backend)
        if group is not None:
            done = group.reduce_scatter_now(tensor, out, op, timeout)
            if done is not None:
                return done
    return _reduce_scatter(tensor, backend, op, timeout, algorithm, out).run()


def reduce_scatter_async(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                         timeout: float | None = None, algorithm: str | None = None,
                         out: np.ndarray | None = None) -> Work:
    """:func:`reduce_scatter` in the background."""
    return _reduce_scatter(tensor, backend, op, timeout, algorithm, out).submit()


# ----------------------------------------------------------------------------- barrier
def barrier(backend: Backend, *, timeout: float | None = None) -> None:
    """Block until every rank has called barrier.

    The barrier is the collectives' header exchange (Bruck's all-gather of a small header,
    ceil(log2 n) rounds), so a rank that calls another collective instead gets
    :class:`CollectiveMismatchError` on every rank rather than a hang.
    """
    group = group_for(backend)
    if group is not None:
        group.barrier_now(timeout)
        return
    if not isinstance(backend, Backend):
        raise TypeError(f"barrier: backend must be a ferro_backend.Backend, got "
                        f"{type(backend).__name__}")
    _barrier_call(backend, timeout).run()


def _barrier_call(backend: Backend, timeout, seq: int | None = None) -> Call:
    return Call("barrier", backend, timeout, (None, ()), lambda ctx: None, fastpath.barrier,
                seq=seq, hier=lambda h: hierarchical.barrier(h, timeout))
