"""``BufferPool``: the unit-sized arrays an FSDP reuses from step to step instead of allocating.

One pool per :class:`~ferro_fsdp.FSDP`; its :class:`~ferro_fsdp.units.Unit` objects take from
it and give back to it.
"""

from __future__ import annotations

import threading

import numpy as np


class BufferPool:
    """Unit-sized arrays handed out and given back, so that a training step allocates none:
    gathers, full parameters, full gradients and reduce-scatter inputs of every unit come from
    here (torch's caching allocator does the same job). What the pool holds never exceeds what
    was in use at once; thread-safe (reductions give their buffers back when they finish)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, str], list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: np.dtype) -> np.ndarray:
        key = (int(numel), np.dtype(dtype).str)
        with self._lock:
            stack = self._free.get(key)
            if stack:
                return stack.pop()
        return np.empty(numel, dtype)

    def give(self, arr: np.ndarray | None) -> None:
        if arr is None:
            return
        with self._lock:
            self._free.setdefault((arr.size, arr.dtype.str), []).append(arr)

    def held_bytes(self) -> int:
        """Bytes of the free arrays the pool keeps for reuse."""
        with self._lock:
            return sum(a.nbytes for stack in self._free.values() for a in stack)


__all__ = ["BufferPool"]
