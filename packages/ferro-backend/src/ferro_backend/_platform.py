"""Where the same-host transport exists: Linux (cross-memory attach, memfd, futexes).

On Linux the engine's compiled kernels (``ferro_backend.engine._segment``, ``_comm``, ``_calls``, ``_steps``,
``_ring``, ``_watch``) are imported unconditionally with the package (a broken build fails
loudly); on other platforms they are not built, ``ShmBackend`` raises a clear error and
``ferrorun`` defaults to TCP.
"""

from __future__ import annotations

import sys

SAME_HOST_ENGINE = sys.platform.startswith("linux")

if SAME_HOST_ENGINE:  # the engine's kernels, imported unconditionally where they are built
    from .engine import _calls, _comm, _ring, _segment, _steps, _watch  # noqa: F401

__all__ = ["SAME_HOST_ENGINE"]
