"""The same-host engine: one shared segment per group of ranks on a host (Linux).

It owns the segment whole: its memory and layout (declared once, in C: ``_layout.h``), the one
wait loop every kernel uses (``_sync.h``), the collective steps (``_slots``), the point-to-point
rings (``_ring``, :mod:`.rings`, :mod:`.delivery`), cross-memory copies and failure marking
(:mod:`.segment`), and the transport built on it (:class:`~.shm.ShmBackend`). Modules that use
the compiled kernels (:mod:`.segment`, :mod:`.rings`, :mod:`.delivery`) import only on Linux;
:mod:`.shm` imports everywhere and refuses to run elsewhere.
"""

from .._platform import SAME_HOST_ENGINE

#: whether this platform has the engine (Linux); elsewhere only :mod:`.shm` imports, and refuses
AVAILABLE = SAME_HOST_ENGINE

if AVAILABLE:
    from ._slots import API_SIGNATURE, FAILED, FOLD_SIGNATURE, MISMATCH, OK, TIMEOUT, header_hash
    from .rings import RingMesh
    from .segment import Engine

__all__ = ["API_SIGNATURE", "AVAILABLE", "FAILED", "FOLD_SIGNATURE", "MISMATCH", "OK", "TIMEOUT",
           "Engine", "RingMesh", "header_hash"]
