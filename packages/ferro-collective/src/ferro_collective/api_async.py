"""The collectives' ``*_async`` forms: each hands its call to the dispatcher's background
worker and returns a :class:`~ferro_collective.Work` at once; ``Work.wait()`` returns what the
blocking call (:mod:`.api`) would have returned, or raises its error. Calls of one backend run in
the order they were made, one after the other."""

from __future__ import annotations

import numpy as np

from ferro_backend import Backend

from . import compressed as _compressed
from .api import (
    ALL_GATHER,
    ALLREDUCE,
    BROADCAST,
    GATHER,
    REDUCE,
    REDUCE_SCATTER,
    SCATTER,
    op_as_root,
)
from .dispatch import submit
from .ops import ReduceOp
from .wire import Feedback, wire_op
from .work import Work


def allreduce_async(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                    timeout: float | None = None, algorithm: str | None = None,
                    out: np.ndarray | None = None, wire: str | None = None,
                    feedback: Feedback | None = None) -> Work:
    """:func:`allreduce` in the background; ``Work.wait()`` returns its result.

    Parameters
    ----------
    tensor, backend, op, timeout, algorithm, out, wire, feedback
        As for :func:`allreduce`. With ``wire``, every collective of the compressed call
        takes its place in the order of calls now, and the input is encoded now (it may
        change once this returns); ``feedback`` is updated by the time the Work is done.

    Returns
    -------
    Work
        Its :meth:`~Work.wait` returns its result, or raises its error.
    """
    if wire is not None:
        return _compressed.allreduce(tensor, backend, wire_op(op), wire, timeout, out,
                                     background=True, algorithm=algorithm, feedback=feedback)
    return submit(ALLREDUCE, tensor, backend, op, timeout, algorithm, out)


def broadcast_async(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
                    algorithm: str | None = None, out: np.ndarray | None = None) -> Work:
    """:func:`broadcast` in the background.

    Parameters
    ----------
    tensor, backend, root, timeout, algorithm, out
        As for :func:`broadcast`.

    Returns
    -------
    Work
        Its :meth:`~Work.wait` returns its result, or raises its error.
    """
    return submit(BROADCAST, tensor, backend, root, timeout, algorithm, out)


def all_gather_async(tensor, backend: Backend, *, timeout: float | None = None,
                     algorithm: str | None = None, out: np.ndarray | None = None,
                     wire: str | None = None) -> Work:
    """:func:`all_gather` in the background.

    Parameters
    ----------
    tensor, backend, timeout, algorithm, out, wire
        As for :func:`all_gather` (with ``wire``, the input is encoded now).

    Returns
    -------
    Work
        Its :meth:`~Work.wait` returns its result, or raises its error.
    """
    if wire is not None:
        return _compressed.all_gather(tensor, backend, wire, timeout, out,
                                      background=True, algorithm=algorithm)
    return submit(ALL_GATHER, tensor, backend, None, timeout, algorithm, out)


def reduce_scatter_async(tensor, backend: Backend, op: ReduceOp = ReduceOp.SUM, *,
                         timeout: float | None = None, algorithm: str | None = None,
                         out: np.ndarray | None = None, wire: str | None = None) -> Work:
    """:func:`reduce_scatter` in the background.

    Parameters
    ----------
    tensor, backend, op, timeout, algorithm, out, wire
        As for :func:`reduce_scatter` (with ``wire``, the input is encoded now).

    Returns
    -------
    Work
        Its :meth:`~Work.wait` returns its result, or raises its error.
    """
    if wire is not None:
        return _compressed.reduce_scatter(tensor, backend, wire_op(op), wire, timeout, out,
                                          background=True, algorithm=algorithm)
    return submit(REDUCE_SCATTER, tensor, backend, op, timeout, algorithm, out)


def reduce_async(tensor, backend: Backend, root: int = 0, op: ReduceOp = ReduceOp.SUM, *,
                 timeout: float | None = None, out: np.ndarray | None = None) -> Work:
    """:func:`reduce` in the background; ``Work.wait()`` returns its result (None off root).

    Parameters
    ----------
    tensor, backend, root, op, timeout, out
        As for :func:`reduce`.

    Returns
    -------
    Work
        Its :meth:`~Work.wait` returns its result (None off root), or raises its error.
    """
    if isinstance(root, ReduceOp):
        raise op_as_root("reduce_async", backend, root, timeout)
    return submit(REDUCE, tensor, backend, (root, op), timeout, None, out)


def gather_async(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
                 out: np.ndarray | None = None) -> Work:
    """:func:`gather` in the background.

    Parameters
    ----------
    tensor, backend, root, timeout, out
        As for :func:`gather`.

    Returns
    -------
    Work
        Its :meth:`~Work.wait` returns its result (None off root), or raises its error.
    """
    return submit(GATHER, tensor, backend, root, timeout, None, out)


def scatter_async(tensor, backend: Backend, root: int = 0, *, timeout: float | None = None,
                  out: np.ndarray | None = None) -> Work:
    """:func:`scatter` in the background.

    Parameters
    ----------
    tensor, backend, root, timeout, out
        As for :func:`scatter`.

    Returns
    -------
    Work
        Its :meth:`~Work.wait` returns its result, or raises its error.
    """
    return submit(SCATTER, tensor, backend, root, timeout, None, out)


__all__ = ["all_gather_async", "allreduce_async", "broadcast_async", "gather_async",
           "reduce_async", "reduce_scatter_async", "scatter_async"]
