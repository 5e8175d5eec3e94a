"""Where DDP's and FSDP's collectives run: in the background or in the training thread.

Both wrappers start their collectives at fixed points of a step (a DDP bucket once its last
gradient is written, an FSDP unit's gather one unit ahead and its reduce-scatter once its
backward is done). In the **background** (the collectives' ``*_async`` forms) such a collective
runs on another thread while the model computes: a gain when a core is free for that thread.
When the ranks of this host already fill its cores, that thread takes its core from the
model's own computation, and the two time-slice one core (measured here, 2 ranks on 2 cores,
8.4 M parameters: FSDP 1.38x of the compute step in the background against 1.21x in the
training thread; DDP 1.13x against 1.09x). Then the collective runs **in the training thread**
at the same point: the same calls in the same order (so the same bits), on data the step has
just written (a bucket's gradients are still in the cache).

``background=None`` (the wrappers' default) follows ``FERRO_BACKGROUND``: ``on``, ``off``, or
``auto`` (in the background only when this host has a core to spare beyond its ranks; the
choice, ``runs_in_background``, is ferro-collective's, which ferro-torch shares).
"""

from __future__ import annotations

from typing import Any

from ferro_collective import ReduceOp, Work, allreduce, allreduce_async
from ferro_collective.background import ranks_on_this_host, runs_in_background, usable_cores

from .inflight import ready


def start(background: bool, in_background, now, *args: Any, **kwargs: Any) -> Work:
    """``in_background(*args, **kwargs)`` (an ``*_async`` collective), or ``now(*args,
    **kwargs)`` (its blocking form, its error raised here) as a finished
    :class:`~ferro_collective.Work`.

    Parameters
    ----------
    background : bool
        Where it runs (:func:`runs_in_background`).
    in_background, now : callable
        The ``*_async`` collective and its blocking form.
    *args, **kwargs
        Their arguments.

    Returns
    -------
    ferro_collective.Work
    """
    if background:
        return in_background(*args, **kwargs)
    return finished(now(*args, **kwargs), getattr(now, "__name__", "collective"))


def finished(result: Any, name: str) -> Work:
    """A :class:`~ferro_collective.Work` that is done already, with ``result``: what a
    collective run in the training thread (or a hook's own computation) returns.

    Parameters
    ----------
    result : Any
        What its ``wait()`` gives.
    name : str
        The collective's name (for messages).

    Returns
    -------
    ferro_collective.Work
    """
    return Work(name, -1, ready(result))


def mean_in_place(background: bool, flat: Any, backend: Any, *, wire: str | None = None,
                  timeout: float | None = None) -> Work:
    """The mean of ``flat`` over ``backend``'s ranks, written into ``flat`` (a DDP bucket's
    reduction: exact, or on the wire in ``wire``'s format), started as :func:`start` starts it.

    Parameters
    ----------
    background : bool
        Where it runs (:func:`runs_in_background`).
    flat : numpy.ndarray
        The bucket's flat buffer.
    backend : ferro_backend.Backend
    wire : {None, "bf16", "fp16", "int8", "int4"}
        As ``ferro_collective.allreduce``'s.
    timeout : float, optional
        As ``ferro_collective.allreduce``'s.

    Returns
    -------
    ferro_collective.Work
    """
    return start(background, allreduce_async, allreduce, flat, backend, ReduceOp.MEAN,
                 timeout=timeout, out=flat, wire=wire)


__all__ = ["finished", "mean_in_place", "ranks_on_this_host", "runs_in_background", "start",
           "usable_cores"]
