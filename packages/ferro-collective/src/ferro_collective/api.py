"""The collectives: allreduce, broadcast, all_gather, reduce_scatter, barrier, and their async forms.

All ranks of a backend must call the same collectives in the same order (as in torch.distributed).
Inputs are never modified; results are new arrays of the input's dtype, and every rank returns the
same bits. A rank that calls another collective, or the same one with another dtype, shape, op or
root, than its peers gets :class:`CollectiveMismatchError` on every rank, naming what each called.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ferro_backend import DEFAULT_TIMEOUT, Backend, InvalidRankError, SizeMismatchError

from . import algorithms as alg
from . import fastpath
from ._state import state, tag_base
from .header import encode, mismatch_check_enabled
from .ops import KERNEL_DTYPES, ReduceOp, as_op, work_dtype
from .work import Work

DEFAULT_COLLECTIVE_TIMEOUT: float = DEFAULT_TIMEOUT
"""The default :attr:`Backend.timeout` (60 s). A collective's deadline is its backend's
``timeout`` (one source for p2p and collectives); a per-call ``timeout=`` wins."""

#: allreduce messages up to this size use recursive doubling (latency), larger ones the ring
SMALL_MESSAGE_BYTES = 256 << 10

ALGORITHMS = {
    "allreduce": ("auto", "ring", "recursive_doubling", "star"),
    "broadcast": ("auto", "tree", "star"),
    "all_gather": ("auto", "ring", "star"),
    "reduce_scatter": ("auto", "ring", "star"),
}


def _choose(name: str, algorithm: str | None, nbytes: int, n: int) -> str:
    algorithm = algorithm or "auto"
    if algorithm not in ALGORITHMS[name]:
        raise ValueError(f"{name}: unknown algorithm {algorithm!r}; expected one of "
                         f"{ALGORITHMS[name]}")
    if algorithm != "auto":
        return algorithm
    if name == "allreduce":
        return "recursive_doubling" if nbytes <= SMALL_MESSAGE_BYTES or n <= 2 and \
            nbytes <= 4 * SMALL_MESSAGE_BYTES else "ring"
    return "tree" if name == "broadcast" else "ring"


def _as_array(name: str, tensor, backend) -> np.ndarray:
    if not isinstance(backend, Backend):
        raise TypeError(f"{name}: backend must be a ferro_backend.Backend, got "
                        f"{type(backend).__name__}")
    x = np.asarray(tensor)
    if x.dtype.hasobject or x.dtype.itemsize == 0:
        raise TypeError(f"{name}: dtype {x.dtype} cannot be sent")
    return x


def _out(name: str, out, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
    """``out=`` checked: a writable C-contiguous ndarray of the result's shape and dtype."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name}: out must be a numpy array, got {type(out).__name__}")
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise SizeMismatchError(f"{name}: out is {out.dtype}{list(out.shape)}, the result is "
                                f"{np.dtype(dtype)}{list(shape)}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name}: out must be writable and C-contiguous")
    return out


class _Call:
    """One prepared collective: validated, sequenced, ready to run (now or in the background).

    ``body(ctx)`` runs it with the Python algorithms over point-to-point messages; ``fast(group,
    step, header)``, where given, runs it on the same-host engine (``fastpath``), which every
    call on a backend with an engine goes through (in issue order) unless an algorithm was
    forced.
    """

    def __init__(self, name: str, backend: Backend, timeout: float | None, header: tuple,
                 body: Callable[[alg.Ctx], np.ndarray], fast=None,
                 algorithm: str | None = None, seq: int | None = None) -> None:
        self.name = name
        self.backend = backend
        self.timeout = backend.resolve_timeout(timeout, f"{name}: timeout")
        self.seq = state(backend).next_seq() if seq is None else seq
        self.header = header
        self.body = body
        self.fast = fast if algorithm in (None, "auto") else None
        self.group = fastpath.group_for(backend)

    def _python(self, _step=None) -> np.ndarray:
        ctx = alg.Ctx(self.backend, self.name, self.seq, tag_base(self.seq), self.timeout)
        if ctx.n > 1 and (mismatch_check_enabled() or self.name == "barrier"):
            # the header exchange; for a barrier it is the whole barrier
            alg.header_exchange(ctx, encode(self.name, *self.header, seq=self.seq))
        return self.body(ctx)

    def __call__(self) -> np.ndarray:
        if self.group is None:
            return self._python()
        fn = self._python
        if self.fast is not None:
            header = encode(self.name, *self.header, seq=self.seq)
            fn = lambda step: self.fast(self.group, step, header)
        return self.group.run(self.name, self.seq, self.timeout, fn)

    def run(self) -> np.ndarray:
        return self()

    def submit(self) -> Work:
        return Work(self.name, self.seq, state(self.backend).submit(self))


# ----------------------------------------------------------------------------- allreduce
def _allreduce(tensor, backend: Backend, op, timeout, algorithm, out, *,
               seq: int | None = None) -> _Call:
    x = _as_array("allreduce", tensor, backend)
    op = as_op(op)
    wd = work_dtype("allreduce", x.dtype, op)
    n = backend.world_size
    algo = _choose("allreduce", algorithm, x.nbytes, n)
    out = _out("allreduce", out, x.shape, x.dtype)

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
        return _finish(buf.reshape(x.shape), x.dtype, out)

    def fast(group, step, header: bytes) -> np.ndarray:
        result = np.empty(x.shape, x.dtype) if out is None else out
        fastpath.allreduce(group, step, header, np.ascontiguousarray(x).reshape(-1),
                           result.reshape(-1), wd, op)
        return result

    header = (x.dtype, x.shape, op, -1)
    return _Call("allreduce", backend, timeout, header, body, fast, algorithm, seq=seq)


def _finish(result: np.ndarray, dtype: np.dtype, out: np.ndarray | None) -> np.ndarray:
    """``result`` in ``dtype``, in ``out`` when given (no copy when it already is ``out``)."""
    if out is None:
        return result if result.dtype == dtype else result.astype(dtype)
    if not np.may_share_memory(result, out):
        np.copyto(out, result, casting="unsafe")
    return out


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
        SUM, MEAN (float dtypes only), MAX, MIN or PRODUCT. Integer SUM is exact (wrapping like
        numpy); float16/bfloat16 accumulate in float32 and round once.
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
        An unsupported dtype, or MEAN on integers.
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
    if algorithm is None and type(tensor) is np.ndarray and isinstance(op, ReduceOp):
        done = _lean_allreduce(tensor, backend, op, timeout, out)
        if done is not None:
            return done
    return _allreduce(tensor, backend, op, timeout, algorithm, out).run()


def _lean_allreduce(x: np.ndarray, backend, op: ReduceOp, timeout, out) -> np.ndarray | None:
    """The engine's one-step allreduce for the common case (a C-contiguous array of a kernel
    dtype that fits a slot), or None: then the general path validates and runs the call."""
    group = fastpath.group_for(backend)
    if (group is None or x.dtype not in KERNEL_DTYPES or not x.flags.c_contiguous
            or (op is ReduceOp.MEAN and x.dtype.kind != "f")):
        return None
    if out is None:
        out = np.empty(x.shape, x.dtype)
    elif (type(out) is not np.ndarray or out.shape != x.shape or out.dtype != x.dtype
          or not out.flags.c_contiguous or not out.flags.writeable):
        return None
    seq = state(backend).next_seq()
    if group.lean_allreduce(seq, x, out, op, backend.resolve_timeout(timeout,
                                                                      "allreduce: timeout")):
        return out
    return _allreduce(x, backend, op, timeout, None, out, seq=seq).run()


def allreduce_async(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                    timeout: float | None = None, algorithm: str | None = None,
                    out: np.ndarray | None = None) -> Work:
    """:func:`allreduce` in the background; ``Work.wait()`` returns its result."""
    return _allreduce(tensor, backend, op, timeout, algorithm, out).submit()


# ----------------------------------------------------------------------------- broadcast
def _broadcast(tensor, backend: Backend, root: int, timeout, algorithm, out) -> _Call:
    x = _as_array("broadcast", tensor, backend)
    n = backend.world_size
    if not isinstance(root, int | np.integer) or not 0 <= root < n:
        raise InvalidRankError(f"broadcast: root {root!r} is out of range for world_size {n}")
    root = int(root)
    algo = _choose("broadcast", algorithm, x.nbytes, n)
    out = _out("broadcast", out, x.shape, x.dtype)

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
    return _Call("broadcast", backend, timeout, header, body, fast, algorithm)


def broadcast(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
              algorithm: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Every rank returns a copy of ``root``'s ``tensor`` (all ranks pass the same shape/dtype).

    Uses a binomial tree (ceil(log2 n) rounds) by default, ``algorithm="star"`` for the seed's.
    Raises :class:`InvalidRankError` for a root outside ``[0, world_size)``. ``out=``: a
    writable C-contiguous array of the input's shape and dtype to fill (may be the input).
    """
    return _broadcast(tensor, backend, root, timeout, algorithm, out).run()


def broadcast_async(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
                    algorithm: str | None = None, out: np.ndarray | None = None) -> Work:
    """:func:`broadcast` in the background."""
    return _broadcast(tensor, backend, root, timeout, algorithm, out).submit()


# ----------------------------------------------------------------------------- all_gather
def _all_gather(tensor, backend: Backend, timeout, algorithm, out) -> _Call:
    x = _as_array("all_gather", tensor, backend)
    n = backend.world_size
    algo = _choose("all_gather", algorithm, x.nbytes, n)
    shape = (n,) if x.ndim == 0 else (x.shape[0] * n, *x.shape[1:])
    out = _out("all_gather", out, shape, x.dtype)

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
    return _Call("all_gather", backend, timeout, header, body, fast, algorithm)


def all_gather(tensor, backend: Backend, *, timeout: float | None = None,
               algorithm: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order.

    Every rank passes the same shape and dtype. The result's dim 0 is ``world_size`` times the
    input's; a 0-d input gathers to shape ``[world_size]``; zero-size inputs keep their shape
    (dim 0 multiplied). Ring algorithm by default (bandwidth-optimal), ``"star"`` for the seed's.
    """
    return _all_gather(tensor, backend, timeout, algorithm, out).run()


def all_gather_async(tensor, backend: Backend, *, timeout: float | None = None,
                     algorithm: str | None = None, out: np.ndarray | None = None) -> Work:
    """:func:`all_gather` in the background."""
    return _all_gather(tensor, backend, timeout, algorithm, out).submit()


# ----------------------------------------------------------------------------- reduce_scatter
def _reduce_scatter(tensor, backend: Backend, op, timeout, algorithm, out) -> _Call:
    x = _as_array("reduce_scatter", tensor, backend)
    op = as_op(op)
    wd = work_dtype("reduce_scatter", x.dtype, op)
    n = backend.world_size
    if x.ndim == 0:
        raise SizeMismatchError("reduce_scatter: a 0-d tensor cannot be split across ranks")
    if x.shape[0] % n:
        raise SizeMismatchError(f"reduce_scatter: dim 0 of shape {x.shape} ({x.shape[0]}) is "
                                f"not divisible by world_size {n}")
    algo = _choose("reduce_scatter", algorithm, x.nbytes, n)
    out_shape = (x.shape[0] // n, *x.shape[1:])
    out = _out("reduce_scatter", out, out_shape, x.dtype)

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
    return _Call("reduce_scatter", backend, timeout, header, body, fast, algorithm)


def reduce_scatter(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                   timeout: float | None = None, algorithm: str | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
    """Reduce across ranks, then rank ``r`` keeps the ``r``-th of ``world_size`` equal slices
    along dim 0 (dim 0 must be divisible by the world size: else SizeMismatchError).
    ``out=``: a writable C-contiguous array of the slice's shape and dtype to fill."""
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
    if not isinstance(backend, Backend):
        raise TypeError(f"barrier: backend must be a ferro_backend.Backend, got "
                        f"{type(backend).__name__}")
    group = fastpath.group_for(backend)
    if group is not None:
        group.lean_barrier(state(backend).next_seq(),
                           backend.resolve_timeout(timeout, "barrier: timeout"))
        return
    _Call("barrier", backend, timeout, (None, ()), lambda ctx: None, fastpath.barrier).run()
