"""Working buffers the point-to-point algorithms reuse from call to call instead of allocating.

A collective over point-to-point messages needs temporaries the size of its data (recursive
doubling's incoming half, the star's contributions at the root, the ring's fold buffers).
Allocated per call, each is fresh memory: the kernel faults and zeroes every page on first
touch, and on a virtual machine that hands freed memory back to its host (free page reporting)
the host must back every page again. Here, 4 emulated nodes x 2 ranks on 2 cores, recursive
doubling of 64 MiB: its intra-node round took 0.2-0.5 s after another algorithm had run (78%
of the CPU in zeroing pages), 0.05-0.1 s right after itself (the pages not yet handed back);
the whole call 3.0-3.5 s against 2.5 s.

So a call borrows its temporaries (:meth:`ferro_collective.p2p.Ctx.take`) from one pool per
process and gives them back when it returns. A call that fails keeps them: a receive posted
into one may still land. The pool keeps at most ``FERRO_SCRATCH_BYTES`` (the buffers given
back longest ago go first); thread-safe.

Arrays under :data:`SMALLEST` bytes are not pooled: the allocator serves them from its heap,
whose pages stay mapped (glibc maps a fresh block from 128 KiB), and a pool's take and give
cost more than that. Two 4-64 KiB arrays, each page touched: 0.9 us fresh against 3.9 us
through the pool; 256 KiB: 149 us fresh against 4.2 us pooled.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ferro_backend import settings

#: the smallest array (bytes) the pool keeps; smaller ones are allocated fresh every time
SMALLEST = 64 << 10


class ScratchPool:
    """Arrays handed out by (count, dtype) and given back for the next call of that size.

    Parameters
    ----------
    keep_bytes : int, optional
        The most the pool holds between calls; None: ``FERRO_SCRATCH_BYTES`` when asked.
    smallest : int, optional
        Arrays of fewer bytes are allocated fresh, never kept (default :data:`SMALLEST`).
    """

    def __init__(self, keep_bytes: int | None = None, smallest: int = SMALLEST) -> None:
        self._keep = keep_bytes
        self._smallest = smallest
        self._free: OrderedDict[int, tuple[tuple[int, np.dtype], np.ndarray]] = OrderedDict()
        self._by_key: dict[tuple[int, np.dtype], list[int]] = {}
        self._held = 0
        self._lock = threading.Lock()

    def keep_bytes(self) -> int:
        return settings.SCRATCH_BYTES.get() if self._keep is None else self._keep

    def take(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A 1-d array of ``count`` items of ``dtype`` (contents undefined)."""
        dtype = np.dtype(dtype)
        if count * dtype.itemsize < self._smallest:
            return np.empty(count, dtype)
        key = (int(count), dtype)
        with self._lock:
            ids = self._by_key.get(key)
            if ids:
                _, arr = self._free.pop(ids.pop())
                self._held -= arr.nbytes
                return arr
        return np.empty(key[0], dtype)

    def give(self, *arrays: np.ndarray | None) -> None:
        """Keep ``arrays`` (each as :meth:`take` made it; None: nothing) for reuse, within the
        pool's bytes (none under its smallest)."""
        arrays = [a for a in arrays if a is not None and a.nbytes >= self._smallest]
        if not arrays:
            return
        keep = self.keep_bytes()
        with self._lock:
            for arr in arrays:
                if arr.nbytes > keep or id(arr) in self._free:
                    continue
                key = (arr.size, arr.dtype)
                self._free[id(arr)] = (key, arr)
                self._by_key.setdefault(key, []).append(id(arr))
                self._held += arr.nbytes
            while self._held > keep:  # the longest kept go first
                old, (key, arr) = self._free.popitem(last=False)
                self._by_key[key].remove(old)
                self._held -= arr.nbytes

    def held_bytes(self) -> int:
        """Bytes of the arrays kept for reuse."""
        with self._lock:
            return self._held

    def clear(self) -> None:
        """Drop every kept array."""
        with self._lock:
            self._free.clear()
            self._by_key.clear()
            self._held = 0


#: the process's pool
POOL = ScratchPool()

__all__ = ["POOL", "SMALLEST", "ScratchPool"]
