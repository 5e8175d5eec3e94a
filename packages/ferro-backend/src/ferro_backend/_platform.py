"""Where the same-host transport exists: Linux (cross-memory attach, memfd, futexes).

On Linux the compiled kernel ``_shm`` is imported unconditionally (a broken build fails loudly);
on other platforms it is not built, ``_shm`` is None, ``ShmBackend`` raises a clear error and
``ferrorun`` defaults to TCP.
"""

from __future__ import annotations

import sys

SAME_HOST_ENGINE = sys.platform.startswith("linux")

if SAME_HOST_ENGINE:
    from . import _shm
else:  # pragma: no cover - exercised on other platforms only
    _shm = None

__all__ = ["SAME_HOST_ENGINE", "_shm"]
