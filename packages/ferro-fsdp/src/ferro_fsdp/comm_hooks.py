"""DDP communication hooks, in torch's spirit (``DDP.register_comm_hook(state, hook)``): how a
bucket of gradients is averaged over the ranks.

A hook is ``hook(state, bucket) -> Work``: it gets the bucket (:class:`GradBucket`: its flat
buffer of this rank's gradients, the parameters in it) and returns a
:class:`ferro_collective.Work` whose ``wait()`` gives the averaged gradients, a flat array of
the bucket's size (DDP copies it into the bucket unless it is the bucket itself). Every rank
must run the same hook with the same collectives. DDP calls the hook as soon as the bucket's
last gradient is written, while the rest of the backward still runs: a hook whose Work
completes in the background (an ``*_async`` collective) lets the bucket travel while the model
computes. :meth:`GradBucket.background` says whether the DDP runs its own collectives that way
(``ferro_fsdp.background``: where a core is free for them); the allreduce and compression hooks
here follow it, PowerSGD (compute between its two allreduces) runs in the training thread.
The hooks here:

* :func:`allreduce_hook`: what DDP does without a hook (a mean allreduce, in place).
* :func:`fp16_compress_hook`, :func:`bf16_compress_hook`: the bucket travels as half or
  bfloat16 and is folded in float32 (``allreduce(..., wire=...)``, ferro_collective.wire):
  half the bytes of float32, every rank the same bits.
* :func:`powerSGD_hook` with a :class:`PowerSGDState`: PowerSGD (low rank, error feedback,
  warm start), in ``ferro_fsdp.powersgd`` and named here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ferro_backend import Backend
from ferro_collective import Work

from .background import mean_in_place
from .powersgd import PowerSGDState, powerSGD_hook


class GradBucket:
    """One DDP bucket, as a communication hook sees it.

    Parameters
    ----------
    index : int
        Its place in the order buckets are reduced (0 first).
    buffer : numpy.ndarray
        The flat gradients of its parameters, this rank's (each parameter's ``.grad`` is a view).
    parameters : list of ferro_fsdp.Parameter
        Its parameters, in buffer order.
    is_last : bool
        Whether it is the step's last bucket.
    backend : ferro_backend.Backend
        The DDP's backend.
    background : bool, default False
        Whether the DDP runs its collectives in the background (:meth:`background`).
    """

    def __init__(self, index: int, buffer: np.ndarray, parameters: Sequence[Any], is_last: bool,
                 backend: Backend, background: bool = False) -> None:
        self._index, self._buffer, self._params = index, buffer, list(parameters)
        self._last, self.backend, self._background = is_last, backend, bool(background)

    def index(self) -> int:
        """Its place in the order buckets are reduced.

        Returns
        -------
        int
        """
        return self._index

    def buffer(self) -> np.ndarray:
        """The flat gradients (a hook must not keep it past its Work).

        Returns
        -------
        numpy.ndarray
        """
        return self._buffer

    def parameters(self) -> list[Any]:
        """Its parameters, in buffer order.

        Returns
        -------
        list of ferro_fsdp.Parameter
        """
        return list(self._params)

    def gradients(self) -> list[np.ndarray]:
        """Each parameter's gradient: views of :meth:`buffer`, in its parameters' shapes.

        Returns
        -------
        list of numpy.ndarray
        """
        out, offset = [], 0
        for p in self._params:
            out.append(self._buffer[offset:offset + p.data.size].reshape(p.data.shape))
            offset += p.data.size
        return out

    def is_last(self) -> bool:
        """Whether it is the step's last bucket.

        Returns
        -------
        bool
        """
        return self._last

    def background(self) -> bool:
        """Whether the DDP runs its collectives in the background (``FERRO_BACKGROUND``, its
        ``background=``): a hook should start its own the same way, with the ``*_async`` forms
        (the bucket then travels during the rest of the backward), else in this thread.

        Returns
        -------
        bool
        """
        return self._background


def _backend(state: Any, bucket: GradBucket) -> Backend:
    return bucket.backend if state is None else getattr(state, "backend", state)


def allreduce_hook(state: Backend | None, bucket: GradBucket) -> Work:
    """The mean of the bucket over the ranks, in place (DDP's own reduction).

    Parameters
    ----------
    state : ferro_backend.Backend or None
        The backend to reduce over (None: the DDP's).
    bucket : GradBucket

    Returns
    -------
    ferro_collective.Work
    """
    return mean_in_place(bucket.background(), bucket.buffer(), _backend(state, bucket))


def _compressed(state: Backend | None, bucket: GradBucket, wire: str) -> Work:
    """The mean of the bucket, sent in ``wire``'s format and folded in float32, in place."""
    return mean_in_place(bucket.background(), bucket.buffer(), _backend(state, bucket), wire=wire)


def fp16_compress_hook(state: Backend | None, bucket: GradBucket) -> Work:
    """The mean of the bucket, sent as IEEE half (``wire="fp16"``), folded in float32.

    Parameters
    ----------
    state : ferro_backend.Backend or None
        The backend to reduce over (None: the DDP's).
    bucket : GradBucket

    Returns
    -------
    ferro_collective.Work
    """
    return _compressed(state, bucket, "fp16")


def bf16_compress_hook(state: Backend | None, bucket: GradBucket) -> Work:
    """The mean of the bucket, sent as bfloat16 (``wire="bf16"``), folded in float32.

    Parameters
    ----------
    state : ferro_backend.Backend or None
        The backend to reduce over (None: the DDP's).
    bucket : GradBucket

    Returns
    -------
    ferro_collective.Work
    """
    return _compressed(state, bucket, "bf16")


__all__ = ["GradBucket", "PowerSGDState", "allreduce_hook", "bf16_compress_hook",
           "fp16_compress_hook", "powerSGD_hook"]
