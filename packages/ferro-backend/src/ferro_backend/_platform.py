"""Where the same-host transport exists: Linux (cross-memory attach, memfd, futexes).

On Linux the compiled kernels ``_shm`` and ``_ring`` are imported unconditionally (a broken
build fails loudly); on other platforms they are not built, both are None, ``ShmBackend`` raises
a clear error and ``ferrorun`` defaults to TCP.
"""

from __future__ import annotations

import sys

SAME_HOST_ENGINE = sys.platform.startswith("linux")

if SAME_HOST_ENGINE:
    from . import _ring, _shm
else:  # pragma: no cover - exercised on other platforms only
    _shm = _ring = None

__all__ = ["SAME_HOST_ENGINE", "_ring", "_shm"]
