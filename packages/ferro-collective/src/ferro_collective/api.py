"""The collectives' public entry points: allreduce, broadcast, all_gather, reduce_scatter,
barrier, and the rooted reduce, gather and scatter, with their async forms.

All ranks of a backend must call the same collectives in the same order (as in torch.distributed).
Inputs are never modified; results are new arrays of the input's dtype (or ``out=``), and every
rank returns the same bits. A rank that calls another collective, or the same one with another
dtype, shape, op or root, than its peers gets :class:`CollectiveMismatchError` on every rank,
naming what each called.

Each function hands its call to the dispatcher (:mod:`.dispatch`), which runs it with the
collective's module (:mod:`.allreduce`, :mod:`.broadcast`, ...): the engine's one-call path, the
engine, hierarchical stages or the point-to-point algorithms.
"""

from __future__ import annotations

import numpy as np

from ferro_backend import DEFAULT_TIMEOUT, Backend

from . import _fastcall, rooted
from . import all_gather as _all_gather
from . import allreduce as _allreduce
from . import barrier as _barrier
from . import broadcast as _broadcast
from . import reduce_scatter as _reduce_scatter
from .dispatch import Collective, run, submit
from .ops import ReduceOp
from .work import Work

DEFAULT_COLLECTIVE_TIMEOUT: float = DEFAULT_TIMEOUT
"""The default :attr:`~ferro_backend.Backend.timeout` (60 s). A collective's deadline is its backend's
``timeout`` (one source for p2p and collectives); a per-call ``timeout=`` wins."""

ALLREDUCE = Collective("allreduce", _allreduce.prepare, _fastcall.ALLREDUCE)
BROADCAST = Collective("broadcast", _broadcast.prepare, _fastcall.BROADCAST)
ALL_GATHER = Collective("all_gather", _all_gather.prepare, _fastcall.ALL_GATHER)
REDUCE_SCATTER = Collective("reduce_scatter", _reduce_scatter.prepare, _fastcall.REDUCE_SCATTER)
BARRIER = Collective("barrier", _barrier.prepare, _fastcall.BARRIER)
REDUCE = Collective("reduce", rooted.prepare_reduce)
GATHER = Collective("gather", rooted.prepare_gather, _fastcall.GATHER)
SCATTER = Collective("scatter", rooted.prepare_scatter)


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
    return run(ALLREDUCE, tensor, backend, op, timeout, algorithm, out)


def allreduce_async(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                    timeout: float | None = None, algorithm: str | None = None,
                    out: np.ndarray | None = None) -> Work:
    """:func:`allreduce` in the background; ``Work.wait()`` returns its result."""
    return submit(ALLREDUCE, tensor, backend, op, timeout, algorithm, out)


def broadcast(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
              algorithm: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Every rank returns a copy of ``root``'s ``tensor`` (all ranks pass the same shape/dtype).

    Uses a binomial tree (ceil(log2 n) rounds) by default, ``algorithm="star"`` for the seed's.
    Raises :class:`~ferro_backend.InvalidRankError` for a root outside ``[0, world_size)``. ``out=``: a
    writable C-contiguous array of the input's shape and dtype to fill (may be the input).
    """
    return run(BROADCAST, tensor, backend, root, timeout, algorithm, out)


def broadcast_async(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
                    algorithm: str | None = None, out: np.ndarray | None = None) -> Work:
    """:func:`broadcast` in the background."""
    return submit(BROADCAST, tensor, backend, root, timeout, algorithm, out)


def all_gather(tensor, backend: Backend, *, timeout: float | None = None,
               algorithm: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order.

    Every rank passes the same shape and dtype. The result's dim 0 is ``world_size`` times the
    input's; a 0-d input gathers to shape ``[world_size]``; zero-size inputs keep their shape
    (dim 0 multiplied). Ring algorithm by default (bandwidth-optimal), ``"star"`` for the seed's.
    """
    return run(ALL_GATHER, tensor, backend, None, timeout, algorithm, out)


def all_gather_async(tensor, backend: Backend, *, timeout: float | None = None,
                     algorithm: str | None = None, out: np.ndarray | None = None) -> Work:
    """:func:`all_gather` in the background."""
    return submit(ALL_GATHER, tensor, backend, None, timeout, algorithm, out)


def reduce_scatter(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                   timeout: float | None = None, algorithm: str | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
    """Reduce across ranks, then rank ``r`` keeps the ``r``-th of ``world_size`` equal slices
    along dim 0 (dim 0 must be divisible by the world size: else SizeMismatchError).
    ``out=``: a writable C-contiguous array of the slice's shape and dtype to fill."""
    return run(REDUCE_SCATTER, tensor, backend, op, timeout, algorithm, out)


def reduce_scatter_async(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                         timeout: float | None = None, algorithm: str | None = None,
                         out: np.ndarray | None = None) -> Work:
    """:func:`reduce_scatter` in the background."""
    return submit(REDUCE_SCATTER, tensor, backend, op, timeout, algorithm, out)


def barrier(backend: Backend, *, timeout: float | None = None) -> None:
    """Block until every rank has called barrier.

    The barrier is the collectives' header exchange (Bruck's all-gather of a small header,
    ceil(log2 n) rounds), so a rank that calls another collective instead gets
    :class:`~ferro_backend.CollectiveMismatchError` on every rank rather than a hang.
    """
    run(BARRIER, None, backend, None, timeout)


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
    return run(REDUCE, tensor, backend, (root, op), timeout, None, out)


def reduce_async(tensor, backend: Backend, root: int = 0, op: ReduceOp = ReduceOp.SUM, *,
                 timeout: float | None = None, out: np.ndarray | None = None) -> Work:
    """:func:`reduce` in the background; ``Work.wait()`` returns its result (None off root)."""
    return submit(REDUCE, tensor, backend, (root, op), timeout, None, out)


def gather(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
           out: np.ndarray | None = None) -> np.ndarray | None:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order, on ``root`` only.

    Every rank passes the same shape and dtype (else CollectiveMismatchError on every rank). A
    0-d input gathers to shape ``[world_size]``. ``out=``: on the root, a writable C-contiguous
    array of the result's shape and dtype to fill (ignored elsewhere). Binomial tree for small
    blocks, direct sends to the root for large ones; the engine on a ``ShmBackend``.

    Returns the gathered array on ``root``, None on the other ranks. Raises
    :class:`~ferro_backend.InvalidRankError` for a root outside ``[0, world_size)``.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> run_ranks(lambda b: gather(np.array([b.rank, 10 * b.rank]), b), 2)
    [array([ 0,  0,  1, 10]), None]
    """
    return run(GATHER, tensor, backend, root, timeout, None, out)


def gather_async(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
                 out: np.ndarray | None = None) -> Work:
    """:func:`gather` in the background."""
    return submit(GATHER, tensor, backend, root, timeout, None, out)


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
    return run(SCATTER, tensor, backend, root, timeout, None, out)


def scatter_async(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
                  out: np.ndarray | None = None) -> Work:
    """:func:`scatter` in the background."""
    return submit(SCATTER, tensor, backend, root, timeout, None, out)


__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT", "all_gather", "all_gather_async", "allreduce",
           "allreduce_async", "barrier", "broadcast", "broadcast_async", "gather",
           "gather_async", "reduce", "reduce_async", "reduce_scatter", "reduce_scatter_async",
           "scatter", "scatter_async"]
