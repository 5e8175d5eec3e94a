"""CPU tensors as numpy arrays that share their memory (no copy), and back.

bfloat16 tensors are seen as ``ml_dtypes.bfloat16`` arrays (the dtype ferro-collective reduces
in float32 and rounds once), bool tensors as bool arrays (reductions see them as uint8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np
import torch

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def check_cpu(name: str, t: torch.Tensor) -> None:
    if isinstance(t, torch.Tensor) and t.is_cpu and t.layout is torch.strided:
        return  # the common case, in three cheap checks
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: backend 'ferro' takes CPU tensors, got a tensor on {t.device} "
                         "(use a 'cpu:ferro,cuda:nccl' backend string for GPU tensors)")
    if t.is_sparse or t.layout != torch.strided:
        raise ValueError(f"{name}: backend 'ferro' takes dense strided tensors, got {t.layout}")


def as_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of the contiguous CPU tensor ``t`` (same memory, same shape)."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def flat(t: torch.Tensor) -> np.ndarray:
    """:func:`as_array` of the contiguous ``t``, 1-d."""
    if t.dtype is not torch.bfloat16:
        try:  # the common case: no grad, no conjugate or negative bit (1 us, not 3)
            return t.numpy().reshape(-1)
        except RuntimeError:
            pass
    return as_array(t).reshape(-1)


class _Writable:
    """:func:`writable`'s context (a class: a generator-based one costs 2 us a call)."""

    __slots__ = ("_t", "_tmp")

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t
        self._tmp: torch.Tensor | None = None

    def __enter__(self) -> np.ndarray:
        if self._t.is_contiguous():
            return flat(self._t)
        self._tmp = self._t.contiguous()
        return flat(self._tmp)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._tmp is not None and exc_type is None:
            with torch.no_grad():
                self._t.copy_(self._tmp)
        return False


def writable(t: torch.Tensor) -> _Writable:
    """A context giving a 1-d array to write ``t``'s new contents into: ``t``'s own memory
    when it is contiguous, else a contiguous copy that is written back into ``t`` on
    success."""
    return _Writable(t)


def update(t: torch.Tensor, fill: Callable[[np.ndarray], None]) -> None:
    """``fill(a)`` with ``a`` a 1-d array that becomes ``t``'s contents: ``t``'s own memory
    when it is contiguous (the common case, without a context's cost), else as
    :func:`writable`."""
    if t.is_contiguous():
        fill(flat(t))
        return
    with writable(t) as a:
        fill(a)


def readable(t: torch.Tensor) -> np.ndarray:
    """A 1-d array of ``t``'s contents: a view when contiguous, else one copy."""
    return flat(t if t.is_contiguous() else t.contiguous())


def span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-d tensor covering ``tensors`` when they lie back to back in one storage (as the
    chunks of one contiguous tensor do), else None: then a list can be filled or read without
    a staging copy."""
    if not tensors:
        return None
    first = tensors[0]
    n, size = first.numel(), first.element_size()
    base = first.untyped_storage().data_ptr()
    for i, t in enumerate(tensors):
        if (not t.is_contiguous() or t.dtype != first.dtype or t.numel() != n
                or t.untyped_storage().data_ptr() != base
                or t.data_ptr() != first.data_ptr() + i * n * size):
            return None
    return first.detach().as_strided((n * len(tensors),), (1,), first.storage_offset())


__all__ = ["BFLOAT16", "as_array", "check_cpu", "flat", "readable", "span", "update", "writable"]
