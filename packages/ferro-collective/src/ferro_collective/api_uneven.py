"""The public entry points of the collectives whose sizes not every rank knows in advance:
all_gather_v, all_to_all, all_to_all_single (:mod:`.exchange`) and the object collectives
broadcast_object and all_gather_object (:mod:`.objects`), each with a metadata round first
(:class:`~.metadata_step.MetaPlan`).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import numpy as np

from ferro_backend import Backend

from .arguments import check_out
from .dispatch import run, submit
from .exchange import list_out_refused
from .records import (
    ALL_GATHER_OBJECT,
    ALL_GATHER_V,
    ALL_TO_ALL,
    ALL_TO_ALL_SINGLE,
    BROADCAST_OBJECT,
)
from .work import Work


def all_gather_v(tensor, backend: Backend, *, timeout: float | None = None,
                 out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """Every rank's ``tensor``, in rank order; dim 0 may differ between ranks.

    Every rank passes the same dtype and the same shape after dim 0 (or every rank a 0-d
    array); otherwise every rank raises :class:`~ferro_backend.CollectiveMismatchError` naming what each
    passed. Returns a list of ``world_size`` new arrays (index ``r`` = rank ``r``'s, zero rows
    allowed), the same on every rank. A metadata round (ceil(log2 n) small messages) exchanges
    the row counts, then the ring all-gather moves the data. Inputs are not modified.

    Parameters
    ----------
    tensor : array_like
        This rank's rows (any dim 0, zero included). Not modified.
    backend : ferro_backend.Backend
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: ``backend.timeout``).
    out : sequence of numpy.ndarray, optional
        ``world_size`` writable C-contiguous arrays, entry ``r`` of rank ``r``'s shape and the
        dtype, filled and returned (as a list). Checked before the call for all this rank
        knows (the list, each entry's type, dtype, flags and shape after dim 0, this rank's
        own entry whole): a wrong one is refused, every rank raises (its peers
        CollectiveMismatchError naming it). The other entries' dim 0 is known only from the
        metadata round: a wrong one raises SizeMismatchError on this rank alone, after the
        data moved (its peers' calls return).

    Returns
    -------
    list of numpy.ndarray
        ``world_size`` new arrays, entry ``r`` rank ``r``'s ``tensor``; equal on every rank.

    Raises
    ------
    TypeError
        An unsupported dtype.
    TypeError, ValueError, SizeMismatchError
        A wrong ``out`` (see ``out``: before the call, or on this rank alone after it).
    CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for every collective.
        (CollectiveMismatchError: another dtype or trailing shape than a peer's.)

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> [[a.tolist() for a in res] for res in
    ...  run_ranks(lambda b: all_gather_v(np.arange(b.rank + 1), b), 2)]
    [[[0], [0, 1]], [[0], [0, 1]]]
    """
    return _into("all_gather_v", out, run(ALL_GATHER_V, tensor, backend, None, timeout,
                                          _path("all_gather_v", out, tensor, backend), out))


def all_gather_v_async(tensor, backend: Backend, *, timeout: float | None = None,
                       out: Sequence[np.ndarray] | None = None) -> Work:
    """:func:`all_gather_v` in the background; ``Work.wait()`` returns the list.

    Parameters
    ----------
    tensor, backend, timeout, out
        As for :func:`all_gather_v`.

    Returns
    -------
    Work
        Its :meth:`~Work.wait` returns the list, or raises its error.
    """
    return _into_later("all_gather_v", out, submit(ALL_GATHER_V, tensor, backend, None, timeout,
                                                   None, out))


def all_to_all(tensors: Sequence, backend: Backend, *, timeout: float | None = None,
               out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """Send ``tensors[r]`` to rank ``r``; return the list whose entry ``r`` came from rank ``r``.

    ``tensors``: a list of ``world_size`` arrays of one dtype and one shape after dim 0 (dim 0
    may differ, zero rows included; or all 0-d), the same dtype and trailing shape on every rank
    (else CollectiveMismatchError on every rank). A list of the wrong length or mixed dtypes is
    a ValueError on that rank and a CollectiveMismatchError on the others. Pairwise exchange
    after a metadata round that exchanges the row counts. Inputs are not modified.

    Parameters
    ----------
    tensors : sequence of array_like
        ``world_size`` arrays, ``tensors[r]`` for rank ``r``. Not modified.
    backend : ferro_backend.Backend
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: ``backend.timeout``).
    out : sequence of numpy.ndarray, optional
        ``world_size`` writable C-contiguous arrays, entry ``r`` of the shape rank ``r`` sends
        here and the dtype, filled and returned (as a list). Checked before the call for all
        this rank knows (the list, each entry's type, dtype, flags and shape after dim 0): a
        wrong one is refused, every rank raises (its peers CollectiveMismatchError naming it).
        Dim 0 is known only from the metadata round: a wrong one raises SizeMismatchError on
        this rank alone, after the data moved (its peers' calls return).

    Returns
    -------
    list of numpy.ndarray
        ``world_size`` new arrays, entry ``r`` what rank ``r`` sent to this rank.

    Raises
    ------
    TypeError
        ``tensors`` is not a list or tuple, or an unsupported dtype.
    ValueError
        Not ``world_size`` tensors, or mixed dtypes or trailing shapes: on this rank (the
        others get CollectiveMismatchError).
    TypeError, ValueError, SizeMismatchError
        A wrong ``out`` (see ``out``: before the call, or on this rank alone after it).
    CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for every collective.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> res = run_ranks(lambda b: all_to_all([np.array([10 * b.rank + d]) for d in range(2)],
    ...                                      b), 2)
    >>> [[a.tolist() for a in r] for r in res]
    [[[0], [10]], [[1], [11]]]
    """
    return _into("all_to_all", out, run(ALL_TO_ALL, tensors, backend, None, timeout,
                                        _path("all_to_all", out, tensors, backend), out))


def all_to_all_async(tensors: Sequence, backend: Backend, *, timeout: float | None = None,
                     out: Sequence[np.ndarray] | None = None) -> Work:
    """:func:`all_to_all` in the background.

    Parameters
    ----------
    tensors, backend, timeout, out
        As for :func:`all_to_all`.

    Returns
    -------
    Work
        Its :meth:`~Work.wait` returns the list, or raises its error.
    """
    return _into_later("all_to_all", out, submit(ALL_TO_ALL, tensors, backend, None, timeout,
                                                 None, out))


def all_to_all_single(tensor, backend: Backend, *, send_splits=None, recv_splits=None,
                      timeout: float | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Split ``tensor`` along dim 0 by ``send_splits`` and send piece ``d`` to rank ``d``;
    return what every rank sent us, concatenated along dim 0 in rank order.

    As ``torch.distributed.all_to_all_single``: ``send_splits``/``recv_splits`` are
    ``world_size`` row counts (None: equal splits; ``send_splits`` must add up to dim 0).
    Every rank checks every rank's splits against the others' (rank ``r``'s ``send_splits[d]``
    must equal rank ``d``'s ``recv_splits[r]``), so a disagreement is the same
    SizeMismatchError on every rank. The dtype and trailing shape must agree across ranks
    (else CollectiveMismatchError). ``out=``: a writable C-contiguous array of the result's
    shape and dtype to fill and return. Inputs are not modified.

    Parameters
    ----------
    tensor : array_like
        The rows to send (not 0-d). Not modified.
    backend : ferro_backend.Backend
    send_splits, recv_splits : sequence of int, optional
        ``world_size`` non-negative row counts sent to / received from each rank (default
        None: dim 0 split equally, which must then be divisible by the world size).
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: ``backend.timeout``).
    out : numpy.ndarray, optional
        A writable C-contiguous array of the result's shape and dtype to fill and return.
        Checked before the call for all this rank knows (its type, dtype, flags, shape after
        dim 0, and dim 0 where ``recv_splits`` are given): a wrong one is refused, every rank
        raises (its peers CollectiveMismatchError naming it). Without ``recv_splits`` dim 0 is
        known only from the metadata round: a wrong one raises SizeMismatchError on this rank
        alone, after the data moved (its peers' calls return).

    Returns
    -------
    numpy.ndarray
        ``out``, or a new array: the received rows, concatenated in rank order.

    Raises
    ------
    SizeMismatchError (a ValueError)
        Splits that do not add up to dim 0 or disagree between ranks, a 0-d ``tensor``, or
        dim 0 not divisible when splits are None: on every rank.
    ValueError, TypeError
        Splits that are not ``world_size`` integers or are negative; ``out`` not a numpy array,
        read-only or strided.
    CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for every collective.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> run_ranks(lambda b: all_to_all_single(np.arange(4) + 10 * b.rank, b), 2)
    [array([ 0,  1, 10, 11]), array([ 2,  3, 12, 13])]
    """
    return run(ALL_TO_ALL_SINGLE, tensor, backend, (send_splits, recv_splits), timeout, None,
               out)


def all_to_all_single_async(tensor, backend: Backend, *, send_splits=None, recv_splits=None,
                            timeout: float | None = None, out: np.ndarray | None = None) -> Work:
    """:func:`all_to_all_single` in the background.

    Parameters
    ----------
    tensor, backend, send_splits, recv_splits, timeout, out
        As for :func:`all_to_all_single`.

    Returns
    -------
    Work
        Its :meth:`~Work.wait` returns the array, or raises its error.
    """
    return submit(ALL_TO_ALL_SINGLE, tensor, backend, (send_splits, recv_splits), timeout,
                  None, out)


def broadcast_object(obj, backend: Backend, root: int = 0, *,
                     timeout: float | None = None) -> object:
    """Every rank returns ``root``'s ``obj`` (the others' ``obj`` is ignored; pass None).

    The root pickles ``obj`` (highest protocol) and returns ``obj`` itself; every other rank
    returns a new object unpickled from the root's bytes (a small metadata round carries the
    size, then a binomial-tree broadcast the bytes; on the same-host engine the bytes ride in
    that round). **Unpickling runs code chosen by the root: use
    this only among authenticated ranks.**

    Parameters
    ----------
    obj : object
        On ``root``: any picklable object. Ignored on the other ranks.
    backend : ferro_backend.Backend
    root : int, default 0
        The rank whose ``obj`` every rank returns.
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: ``backend.timeout``).

    Returns
    -------
    object
        ``obj`` itself on the root, an unpickled copy of it elsewhere.

    Raises
    ------
    InvalidRankError
        ``root`` is not in ``[0, world_size)``.
    TypeError
        The root's object cannot be pickled: on every rank, naming the reason.
    pickle.UnpicklingError
        This rank cannot rebuild the object (a class it cannot import...): on that rank only.
    CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for every collective.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> run_ranks(lambda b: broadcast_object({"lr": 0.1} if b.rank == 0 else None, b), 2)
    [{'lr': 0.1}, {'lr': 0.1}]
    """
    return run(BROADCAST_OBJECT, obj, backend, root, timeout)


def all_gather_object(obj, backend: Backend, *, timeout: float | None = None) -> list:
    """Every rank's ``obj``, in rank order, on every rank (each entry unpickled anew, this
    rank's own included, so the lists are equal and share nothing with the inputs).

    Pickles of any size per rank (a metadata round exchanges the sizes, then the ring
    all-gather moves the bytes; on the same-host engine the bytes ride in that round).
    **Unpickling runs code chosen by the sending rank: use this
    only among authenticated ranks.**

    Parameters
    ----------
    obj : object
        This rank's picklable object.
    backend : ferro_backend.Backend
    timeout : float, optional
        Seconds before CollectiveTimeoutError (default: ``backend.timeout``).

    Returns
    -------
    list
        ``world_size`` objects, entry ``r`` rank ``r``'s ``obj`` (unpickled anew).

    Raises
    ------
    TypeError
        Some rank's object cannot be pickled: on every rank, naming the ranks and reasons.
    pickle.UnpicklingError
        This rank cannot rebuild some rank's object: on that rank only.
    CollectiveMismatchError, CollectiveTimeoutError, PeerClosedError
        As for every collective.

    Examples
    --------
    >>> from ferro_backend.testing import run_ranks
    >>> run_ranks(lambda b: all_gather_object(("rank", b.rank), b), 2)
    [[('rank', 0), ('rank', 1)], [('rank', 0), ('rank', 1)]]
    """
    return run(ALL_GATHER_OBJECT, obj, backend, None, timeout)


def _path(name: str, out, tensors, backend) -> str | None:
    """The ``algorithm`` a list collective runs with: None (its one-call path may take it), or
    ``"auto"`` (the general path) where its prepare step refuses ``out=``
    (:func:`.exchange.list_out_refused`; the one-call path does not see ``out=``)."""
    return "auto" if list_out_refused(name, out, tensors, backend) else None


def _into(name: str, out, got: list[np.ndarray]) -> list[np.ndarray]:
    """``got`` (a list collective's result) copied into ``out`` (a sequence of ``world_size``
    arrays, each checked as any collective's ``out=``) and returned as a list; ``got`` itself
    where ``out`` is None. The call has completed on every rank by now, so a wrong ``out``
    raises here alone."""
    if out is None:
        return got
    if isinstance(out, np.ndarray) or not isinstance(out, Sequence):
        raise TypeError(f"{name}: out must be a list of {len(got)} numpy arrays, got "
                        f"{type(out).__name__}")
    if len(out) != len(got):
        raise ValueError(f"{name}: out has {len(out)} arrays, the result {len(got)} (one per rank)")
    for r, (o, g) in enumerate(zip(out, got)):
        np.copyto(check_out(f"{name}: out[{r}]", o, g.shape, g.dtype), g)
    return list(out)


def _into_later(name: str, out, work: Work) -> Work:
    """``work``, whose result goes into ``out`` (:func:`_into`) when it completes."""
    if out is None:
        return work
    future: concurrent.futures.Future = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        try:
            future.set_result(_into(name, out, f.result()))
        except BaseException as exc:  # (the collective's error, or a wrong out)
            future.set_exception(exc)

    work.future.add_done_callback(done)
    return Work(work.name, work.seq, future)


__all__ = ["all_gather_object", "all_gather_v", "all_gather_v_async", "all_to_all",
           "all_to_all_async", "all_to_all_single", "all_to_all_single_async",
           "broadcast_object"]
