"""Communicators of several ranks on one segment, in one process (ranks as threads)."""

import os

from ferro_backend.engine import _comm, _segment


def comms(n: int = 2, slot_bytes: int = 4096, ring_bytes: int = 4096, *, spin: int = 100,
          yields: int = 10, timeout: float = 10.0, size: int | None = None) -> list:
    """``n`` ``_comm.Comm`` of ranks 0..n-1 mapping one anonymous segment (``size`` bytes, by
    default the layout's)."""
    need = _segment.layout(n, slot_bytes, ring_bytes)["size"] if size is None else size
    fd = os.memfd_create("ferro-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(need, 1))
        return [_comm.Comm(fd, need, n, r, slot_bytes, ring_bytes, spin, yields, timeout)
                for r in range(n)]
    finally:
        os.close(fd)
