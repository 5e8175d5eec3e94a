"""CPU tensors as numpy arrays that share their memory (no copy), and back.

bfloat16 tensors are seen as ``ml_dtypes.bfloat16`` arrays (the dtype ferro-collective reduces
in float32 and rounds once), bool tensors as bool arrays (reductions see them as uint8).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import ml_dtypes
import numpy as np
import torch

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def check_cpu(name: str, t: torch.Tensor) -> None:
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
    return as_array(t).reshape(-1)


@contextlib.contextmanager
def writable(t: torch.Tensor) -> Iterator[np.ndarray]:
    """A 1-d array to write ``t``'s new contents into: ``t``'s own memory when it is
    contiguous, else a contiguous copy that is written back into ``t`` on success."""
    if t.is_contiguous():
        yield flat(t)
        return
    tmp = t.contiguous()
    yield flat(tmp)
    with torch.no_grad():
        t.copy_(tmp)


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


__all__ = ["BFLOAT16", "as_array", "check_cpu", "flat", "readable", "span", "writable"]
