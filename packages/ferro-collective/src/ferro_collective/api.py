"""The collectives' public entry points: allreduce, broadcast, all_gather, reduce_scatter,
barrier, and the rooted reduce, gather and scatter (their ``*_async`` forms:
:mod:`.api_async`).

All ranks of a backend must call the same collectives in the same order (as in torch.distributed).
Inputs are never modified; results are new arrays of the input's dtype (or ``out=``), and every
rank returns the same bits. A rank that calls another collective, or the same one with another
dtype, shape, op or root, than its peers gets :class:`CollectiveMismatchError` on every rank,
naming what each called; a rank whose own arguments are wrong tells its peers the same way
(they raise in the same call, naming it and its error). An error's traceback ends at the public
call (``FERRO_TRACEBACK=full`` keeps the frames inside ferro).

Each function hands its call to the dispatcher (:mod:`.dispatch`), which runs it with the
collective's module (:mod:`.allreduce`, :mod:`.broadcast`, ...): the engine's one-call path, the
engine, hierarchical stages or the point-to-point algorithms.

This file is plain Python, built as it is by Cython into an extension module (``meson.build``):
a call into a compiled function with keywords costs about 100-160 ns less than the
interpreter's frame, a quarter of a barrier's or a 4 KiB allreduce's time on the engine.
"""

from __future__ import annotations

import numpy as np

from ferro_backend import DEFAULT_TIMEOUT, Backend

from . import compressed as _compressed
from .dispatch import run, run_barrier
from .executors import Refusal
from .ops import ReduceOp
from .records import (
    ALL_GATHER,
    ALLREDUCE,
    BARRIER,
    BROADCAST,
    GATHER,
    REDUCE,
    REDUCE_SCATTER,
    SCATTER,
)
from .rooted import scatter_path
from .wire import Feedback, wire_op

DEFAULT_COLLECTIVE_TIMEOUT: float = DEFAULT_TIMEOUT
"""The default :attr:`~ferro_backend.Backend.timeout` (60 s). A collective's deadline is its backend's
``timeout`` (one source for p2p and collectives); a per-call ``timeout=`` wins."""

def allreduce(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
              timeout: float | None = None, algorithm: str | None = None,
              out: np.ndarray | None = None, wire: str | None = None,
              feedback: Feedback | None = None) -> np.ndarray:
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
    wire : {None, "bf16", "fp16", "int8", "int4"}
        None: exact. Otherwise the data travels in that format (int8, int4: blocks of 256
        values with a float32 scale each) and is folded in float32 (:mod:`ferro_collective.wire`); on a
        multi-node job only the cross-node stage is compressed. Float dtypes; SUM, MEAN, MAX,
        MIN, PRODUCT; not with ``algorithm``.
    feedback : ferro_collective.wire.Feedback, optional
        With ``wire``, SUM or MEAN: error feedback. What this call's encodings round away (this
        rank's input, and the chunk it folds before the all-gather) is kept there and added
        to the next call's, so the error of a sum over a series of calls stays that of one
        call (gradients over steps). One per series of same-sized calls; this rank's own.
        Without ``wire`` it is left as it is (an exact call rounds nothing away).

    Returns
    -------
    numpy.ndarray
        ``out``, or a new array of the input's shape and dtype; bit-identical on every rank, and
        the same bits for the same inputs run after run.

    Raises
    ------
    TypeError
        An unsupported dtype, MEAN on integers, or a bitwise op on floats.
    ValueError
        An unknown ``algorithm``; ``out`` not writable and C-contiguous (SizeMismatchError: of
        another shape or dtype).
    CollectiveMismatchError
        Ranks called different collectives or shapes/dtypes/ops, or a peer refused the call
        (its own arguments were wrong: its message names that rank and its error).
    CollectiveTimeoutError, PeerClosedError
        A peer did not arrive in time, or is gone.

    Notes
    -----
    A rank whose own arguments are wrong (the TypeError and ValueError above) still takes the
    call's place in the order and tells its peers, who raise CollectiveMismatchError in the
    same call instead of waiting for their deadline; it raises its own error once they have
    arrived (the ``*_async`` forms raise it at once and tell the peers in the background).
    The order of calls stays intact: the next call on every rank is the next call. Not on a
    multi-node job's stages without an engine, nor with the mismatch check off away from the
    engine (no header to tell them by): there, the peers wait for their deadline.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> run_ranks(lambda b: allreduce(np.array([b.rank + 1.0]), b).tolist(), 3)
    [[6.0], [6.0], [6.0]]
    >>> run_ranks(lambda b: allreduce(np.array([0.1, 300.0]), b, wire="bf16").tolist(), 2)
    [[0.2001953125, 600.0], [0.2001953125, 600.0]]
    """
    if wire is not None:
        return _compressed.allreduce(tensor, backend, wire_op(op), wire, timeout, out,
                                     algorithm=algorithm, feedback=feedback)
    return run(ALLREDUCE, tensor, backend, op, timeout, algorithm, out)


#: torch.distributed's name for :func:`allreduce`: the same function
all_reduce = allreduce


def broadcast(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
              algorithm: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Every rank returns a copy of ``root``'s ``tensor``.

    Uses a binomial tree (ceil(log2 n) rounds) by default, ``algorithm="star"`` for the root
    sending to every rank.

    Parameters
    ----------
    tensor : array_like or None
        On ``root`` the array to send; elsewhere one of its shape and dtype, or None (mpi4py's
        ``bcast`` habit): the root's header gives the shape and dtype (arrays of at most six
        dims of a dtype the header rebuilds: not a structured dtype or a datetime of a long
        unit, for which every rank raises CollectiveMismatchError; on a multi-node job's
        stages, and with the mismatch check off away from the engine, non-roots pass
        arrays). Not modified.
    backend : ferro_backend.Backend
    root : int, default 0
        The rank whose ``tensor`` every rank returns.
    timeout, algorithm, out
        As for :func:`allreduce` (``algorithm``: "auto", "tree" or "star"). A non-root that
        passes None learns the shape and dtype only from the root's header: its ``out`` is
        checked before the call for all else (not an array, read-only...: every rank raises),
        for its shape and dtype once the data moved, where a wrong one raises
        SizeMismatchError on that rank alone (its peers return the root's array).

    Returns
    -------
    numpy.ndarray
        ``out`` (may be the input), or a new array: ``root``'s ``tensor``.

    Raises
    ------
    InvalidRankError
        ``root`` is not in ``[0, world_size)``.
    ValueError
        None on the root.
    SizeMismatchError (a ValueError)
        A non-root that passed None: its ``out`` of another shape or dtype than the root's,
        on that rank alone, after the call.
    TypeError, CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for :func:`allreduce`.

    Examples
    --------
    >>> run_ranks(lambda b: broadcast(np.array([b.rank]), b, root=1).tolist(), 2)
    [[1], [1]]
    >>> run_ranks(lambda b: broadcast(np.arange(3) if b.rank == 0 else None, b).tolist(), 2)
    [[0, 1, 2], [0, 1, 2]]
    """
    return run(BROADCAST, tensor, backend, root, timeout, algorithm, out)


def all_gather(tensor, backend: Backend, *, timeout: float | None = None,
               algorithm: str | None = None, out: np.ndarray | None = None,
               wire: str | None = None) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order.

    Every rank passes the same shape and dtype. The result's dim 0 is ``world_size`` times the
    input's; a 0-d input gathers to shape ``[world_size]``; zero-size inputs keep their shape
    (dim 0 multiplied). Ring algorithm by default (bandwidth-optimal), ``"star"`` for every rank
    sending to every rank.

    Parameters
    ----------
    tensor : array_like
        This rank's block. Not modified.
    backend : ferro_backend.Backend
    timeout, algorithm, out, wire
        As for :func:`allreduce` (``algorithm``: "auto", "ring" or "star"; with ``wire``,
        every block, this rank's too, is the decoded one).

    Returns
    -------
    numpy.ndarray
        ``out``, or a new array: the blocks concatenated, the same on every rank.

    Raises
    ------
    TypeError, ValueError, CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for :func:`allreduce`.

    Examples
    --------
    >>> run_ranks(lambda b: all_gather(np.array([b.rank]), b).tolist(), 2)
    [[0, 1], [0, 1]]
    """
    if wire is not None:
        return _compressed.all_gather(tensor, backend, wire, timeout, out,
                                      algorithm=algorithm)
    return run(ALL_GATHER, tensor, backend, None, timeout, algorithm, out)


def reduce_scatter(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                   timeout: float | None = None, algorithm: str | None = None,
                   out: np.ndarray | None = None, wire: str | None = None) -> np.ndarray:
    """Reduce across ranks, then rank ``r`` keeps the ``r``-th of ``world_size`` equal slices
    along dim 0 (dim 0 must be divisible by the world size: else SizeMismatchError).

    Parameters
    ----------
    tensor : array_like
        This rank's contribution (not 0-d). Not modified.
    backend : ferro_backend.Backend
    op, timeout, algorithm
        As for :func:`allreduce` (``algorithm``: "auto", "ring" or "star").
    out : numpy.ndarray, optional
        A writable C-contiguous array of the slice's shape and dtype to fill and return.
    wire : {None, "bf16", "fp16", "int8", "int4"}
        As for :func:`allreduce` (each rank's slices encoded, folded in float32).

    Returns
    -------
    numpy.ndarray
        ``out``, or a new array: this rank's slice of the reduction.

    Raises
    ------
    SizeMismatchError (a ValueError)
        Dim 0 not divisible by the world size, or a 0-d ``tensor``.
    TypeError, ValueError, CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for :func:`allreduce`.

    Examples
    --------
    >>> run_ranks(lambda b: reduce_scatter(np.arange(4) * (b.rank + 1), b).tolist(), 2)
    [[0, 3], [6, 9]]
    """
    if wire is not None:
        return _compressed.reduce_scatter(tensor, backend, wire_op(op), wire, timeout, out,
                                          algorithm=algorithm)
    return run(REDUCE_SCATTER, tensor, backend, op, timeout, algorithm, out)


def barrier(backend: Backend, *, timeout: float | None = None) -> None:
    """Block until every rank has called barrier.

    The barrier is the collectives' header exchange (Bruck's all-gather of a small header,
    ceil(log2 n) rounds), so a rank that calls another collective instead gets
    :class:`~ferro_backend.CollectiveMismatchError` on every rank rather than a hang.

    Parameters
    ----------
    backend, timeout
        As for :func:`allreduce`.

    Raises
    ------
    TypeError, CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for :func:`allreduce`.

    Examples
    --------
    >>> barrier(backend)  # every rank of backend's group calls it
    """
    run_barrier(BARRIER, backend, timeout)


def op_as_root(name: str, backend, root: ReduceOp, timeout) -> TypeError:
    """The TypeError of a reduce (``name``: ``"reduce"`` or ``"reduce_async"``) given an op
    where its root goes; the call is refused as every call whose own arguments are wrong is
    (:class:`.executors.Refusal`): it takes its place in the order of calls and its peers raise
    CollectiveMismatchError in the same call, naming this rank and the error.

    Parameters
    ----------
    name : str
        The public call, named in the error.
    backend : ferro_backend.Backend
        The call's backend (nothing is published where it is no open backend).
    root : ReduceOp
        What was passed where the root goes.
    timeout : float or None
        The call's ``timeout=``: how long the refusal waits for the peers at most.

    Returns
    -------
    TypeError
        The error to raise, saying to pass the op as ``op=``.
    """
    exc = TypeError(f"{name}: {root!r} was passed where the root rank goes; pass the op as "
                    f"op={root!r} ({name}(tensor, backend, root=0, op=...))")
    refused = Refusal.of(REDUCE.name, backend, timeout, exc)
    if refused is not None:
        refused.start()
    return exc


def reduce(tensor, backend: Backend, root: int = 0, op: ReduceOp = ReduceOp.SUM, *,
           timeout: float | None = None, out: np.ndarray | None = None) -> np.ndarray | None:
    """Reduce ``tensor`` element-wise across all ranks; only ``root`` gets the result.

    Parameters
    ----------
    tensor : array_like
        This rank's contribution; every rank passes the same shape and dtype. Not modified.
    backend : ferro_backend.Backend
    root : int, default 0
        The rank that receives the result.
    op : ReduceOp, default ReduceOp.SUM
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
        An unsupported dtype for ``op``, or an op passed where ``root`` goes (saying to pass
        ``op=``; refused as every bad argument is: the peers raise CollectiveMismatchError in
        the same call).
    CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for every collective.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> run_ranks(lambda b: reduce(np.array([b.rank + 1]), b, root=1), 3)
    [None, array([6]), None]
    """
    if isinstance(root, ReduceOp):
        raise op_as_root("reduce", backend, root, timeout)
    return run(REDUCE, tensor, backend, (root, op), timeout, None, out)


def gather(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
           out: np.ndarray | None = None) -> np.ndarray | None:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order, on ``root`` only.

    Every rank passes the same shape and dtype (else CollectiveMismatchError on every rank). A
    0-d input gathers to shape ``[world_size]``. ``out=``: on the root, a writable C-contiguous
    array of the result's shape and dtype to fill (ignored elsewhere). Binomial tree for small
    blocks, direct sends to the root for large ones; the engine on a ``ShmBackend``.

    Parameters
    ----------
    tensor, backend, timeout, out
        As for :func:`all_gather` (``out``: on the root only).
    root : int, default 0
        The rank that receives the result.

    Returns
    -------
    numpy.ndarray or None
        The gathered array on ``root``, None on the other ranks.

    Raises
    ------
    InvalidRankError, TypeError, ValueError, CollectiveMismatchError, CollectiveTimeoutError
        As for :func:`broadcast`.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> run_ranks(lambda b: gather(np.array([b.rank, 10 * b.rank]), b), 2)
    [array([ 0,  0,  1, 10]), None]
    """
    return run(GATHER, tensor, backend, root, timeout, None, out)


def scatter(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
            out: np.ndarray | None = None) -> np.ndarray:
    """Split ``root``'s ``tensor`` along dim 0 into ``world_size`` equal chunks; rank ``r``
    returns chunk ``r`` (a new array, or ``out``).

    Parameters
    ----------
    tensor : array_like or None
        On ``root``: the array to split (dim 0 divisible by the world size, as for
        :func:`reduce_scatter`), not of a structured dtype (TypeError there, a
        CollectiveMismatchError elsewhere: the other ranks could not rebuild it). The other
        ranks pass None (anything they pass is ignored).
    backend : ferro_backend.Backend
    root : int, default 0
        The rank whose ``tensor`` is split.
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: ``backend.timeout``).
    out : numpy.ndarray, optional
        A writable C-contiguous array of the chunk's shape and dtype to fill and return. On
        the root it is checked before the call (a wrong one: the root refuses, every other
        rank raises CollectiveMismatchError); on the other ranks, which learn the chunk's
        shape and dtype only from the root, all but its shape and dtype are: one of another
        shape or dtype raises SizeMismatchError on that rank alone, after the data moved (its
        peers return their chunks).

    Returns
    -------
    numpy.ndarray
        ``out``, or a new array: chunk ``r`` on rank ``r``.

    Raises
    ------
    InvalidRankError
        ``root`` is not in ``[0, world_size)``.
    SizeMismatchError (a ValueError)
        Dim 0 of the root's tensor is not divisible by the world size, or it is 0-d: on every
        rank (the root's shape reaches every rank first). A non-root's ``out`` of the wrong
        shape or dtype: on that rank alone, after the call (see ``out``).
    CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for every collective; the root passing None is an error on the root and a
        CollectiveMismatchError on the others.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> run_ranks(lambda b: scatter(np.arange(4) if b.rank == 0 else None, b), 2)
    [array([0, 1]), array([2, 3])]
    """
    return run(SCATTER, tensor, backend, root, timeout, scatter_path(tensor, backend, root, out),
               out)


__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT", "all_gather", "allreduce", "barrier", "broadcast",
           "gather", "reduce", "reduce_scatter", "scatter"]
