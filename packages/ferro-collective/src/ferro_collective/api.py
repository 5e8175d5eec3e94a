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
from ._state import state, tag_base
from .header import encode, mismatch_check_enabled
from .ops import WIDENED, ReduceOp, as_op, work_dtype
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


class _Call:
    """One prepared collective: validated, sequenced, ready to run (now or in the background)."""

    def __init__(self, name: str, backend: Backend, timeout: float | None, header: tuple,
                 body: Callable[[alg.Ctx], np.ndarray]) -> None:
        self.name = name
        self.backend = backend
        self.timeout = backend.resolve_timeout(timeout, f"{name}: timeout")
        self.seq = state(backend).next_seq()
        self.header = header
        self.body = body

    def __call__(self) -> np.ndarray:
        ctx = alg.Ctx(self.backend, self.name, self.seq, tag_base(self.seq), self.timeout)
        if ctx.n > 1 and mismatch_check_enabled():
            alg.header_exchange(ctx, encode(self.name, *self.header, seq=self.seq))
        return self.body(ctx)

    def run(self) -> np.ndarray:
        return self()

    def submit(self) -> Work:
        return Work(self.name, self.seq, state(self.backend).submit(self))


# ----------------------------------------------------------------------------- allreduce
def _allreduce(tensor, backend: Backend, op, timeout, algorithm) -> _Call:
    x = _as_array("allreduce", tensor, backend)
    op = as_op(op)
    wd = work_dtype("allreduce", x.dtype, op)
    n = backend.world_size
    algo = _choose("allreduce", algorithm, x.nbytes, n)

    def body(ctx: alg.Ctx) -> np.ndarray:
        buf = np.array(x, dtype=wd, order="C", copy=True).reshape(-1)
        if n > 1 and buf.size:
            {"ring": alg.allreduce_ring, "recursive_doubling": alg.allreduce_recursive_doubling,
             "star": alg.allreduce_star}[algo](ctx, buf, op)
        out = buf.reshape(x.shape)
        return out.astype(x.dtype) if x.dtype in WIDENED else out

    header = (x.dtype, x.shape, op, -1)
    return _Call("allreduce", backend, timeout, header, body)


def allreduce(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
              timeout: float | None = None, algorithm: str | None = None) -> np.ndarray:
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
        "auto" picks recursive doubling for small messages and the ring for large ones.

    Returns
    -------
    numpy.ndarray
        A new array of the input's shape and dtype, bit-identical on every rank, and the same
        bits for the same inputs run after run.

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
    return _allreduce(tensor, backend, op, timeout, algorithm).run()


def allreduce_async(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                    timeout: float | None = None, algorithm: str | None = None) -> Work:
    """:func:`allreduce` in the background; ``Work.wait()`` returns its result."""
    return _allreduce(tensor, backend, op, timeout, algorithm).submit()


# ----------------------------------------------------------------------------- broadcast
def _broadcast(tensor, backend: Backend, root: int, timeout, algorithm) -> _Call:
    x = _as_array("broadcast", tensor, backend)
    n = backend.world_size
    if not isinstance(root, int | np.integer) or not 0 <= root < n:
        raise InvalidRankError(f"broadcast: root {root!r} is out of range for world_size {n}")
    root = int(root)
    algo = _choose("broadcast", algorithm, x.nbytes, n)

    def body(ctx: alg.Ctx) -> np.ndarray:
        buf = np.array(x, order="C", copy=True)
        flat = buf.reshape(-1).view(np.uint8) if buf.size else buf.reshape(-1)
        if n > 1 and buf.size:
            {"tree": alg.broadcast_tree, "star": alg.broadcast_star}[algo](ctx, flat, root)
        return buf

    header = (x.dtype, x.shape, None, root)
    return _Call("broadcast", backend, timeout, header, body)


def broadcast(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
              algorithm: str | None = None) -> np.ndarray:
    """Every rank returns a copy of ``root``'s ``tensor`` (all ranks pass the same shape/dtype).

    Uses a binomial tree (ceil(log2 n) rounds) by default, ``algorithm="star"`` for the seed's.
    Raises :class:`InvalidRankError` for a root outside ``[0, world_size)``.
    """
    return _broadcast(tensor, backend, root, timeout, algorithm).run()


def broadcast_async(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
                    algorithm: str | None = None) -> Work:
    """:func:`broadcast` in the background."""
    return _broadcast(tensor, backend, root, timeout, algorithm).submit()


# ----------------------------------------------------------------------------- all_gather
def _all_gather(tensor, backend: Backend, timeout, algorithm) -> _Call:
    x = _as_array("all_gather", tensor, backend)
    n = backend.world_size
    algo = _choose("all_gather", algorithm, x.nbytes, n)
    shape = (n,) if x.ndim == 0 else (x.shape[0] * n, *x.shape[1:])

    def body(ctx: alg.Ctx) -> np.ndarray:
        block = np.ascontiguousarray(x).reshape(-1)
        out = np.empty(shape, dtype=x.dtype)
        flat = out.reshape(-1)
        if n == 1 or not block.size:
            flat[...] = block
            return out
        b8, o8 = block.view(np.uint8), flat.view(np.uint8)
        {"ring": alg.all_gather_ring, "star": alg.all_gather_star}[algo](ctx, b8, o8)
        return out

    header = (x.dtype, x.shape, None, -1)
    return _Call("all_gather", backend, timeout, header, body)


def all_gather(tensor, backend: Backend, *, timeout: float | None = None,
               algorithm: str | None = None) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order.

    Every rank passes the same shape and dtype. The result's dim 0 is ``world_size`` times the
    input's; a 0-d input gathers to shape ``[world_size]``; zero-size inputs keep their shape
    (dim 0 multiplied). Ring algorithm by default (bandwidth-optimal), ``"star"`` for the seed's.
    """
    return _all_gather(tensor, backend, timeout, algorithm).run()


def all_gather_async(tensor, backend: Backend, *, timeout: float | None = None,
                     algorithm: str | None = None) -> Work:
    """:func:`all_gather` in the background."""
    return _all_gather(tensor, backend, timeout, algorithm).submit()


# ----------------------------------------------------------------------------- reduce_scatter
def _reduce_scatter(tensor, backend: Backend, op, timeout, algorithm) -> _Call:
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

    def body(ctx: alg.Ctx) -> np.ndarray:
        buf = np.array(x, dtype=wd, order="C", copy=True).reshape(-1)
        if n == 1 or not buf.size:
            mine = buf[: buf.size // n]
        else:
            mine = {"ring": alg.reduce_scatter_ring,
                    "star": alg.reduce_scatter_star}[algo](ctx, buf, op)
        out = np.array(mine, dtype=x.dtype, copy=True).reshape(out_shape)
        return out

    header = (x.dtype, x.shape, op, -1)
    return _Call("reduce_scatter", backend, timeout, header, body)


def reduce_scatter(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                   timeout: float | None = None, algorithm: str | None = None) -> np.ndarray:
    """Reduce across ranks, then rank ``r`` keeps the ``r``-th of ``world_size`` equal slices
    along dim 0 (dim 0 must be divisible by the world size: else SizeMismatchError)."""
    return _reduce_scatter(tensor, backend, op, timeout, algorithm).run()


def reduce_scatter_async(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                         timeout: float | None = None, algorithm: str | None = None) -> Work:
    """:func:`reduce_scatter` in the background."""
    return _reduce_scatter(tensor, backend, op, timeout, algorithm).submit()


# ----------------------------------------------------------------------------- barrier
def barrier(backend: Backend, *, timeout: float | None = None) -> None:
    """Block until every rank has called barrier.

    The barrier is the collectives' header exchange (Bruck's all-gather of a small header,
    ceil(log2 n) rounds), so a rank that calls another collective instead gets
    :class:`CollectiveMismatchError` on every rank rather than a hang.
    """
    _as_array("barrier", (), backend)
    call = _Call("barrier", backend, timeout, (), lambda ctx: None)
    if backend.world_size > 1:
        ctx = alg.Ctx(backend, "barrier", call.seq, tag_base(call.seq), call.timeout)
        alg.barrier(ctx)
