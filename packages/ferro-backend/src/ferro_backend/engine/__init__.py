"""The same-host engine: one shared segment per group of ranks on a host (Linux).

It owns the segment whole: its memory and layout (declared once, in C: ``_layout.h``), the one
wait loop every kernel uses (``_sync.h``), the collectives and the order of calls behind one
door (``ferro/engine.h``, ``door.c``, ``_comm``: what C and C++ clients call too, see
:func:`comm_capsule`), the point-to-point
rings (``_ring``, :mod:`.rings`, :mod:`.delivery`), cross-memory copies and failure marking
(:mod:`.segment`), and the transport built on it (:class:`~.shm.ShmBackend`). Modules that use
the compiled kernels (:mod:`.segment`, :mod:`.rings`, :mod:`.delivery`) import only on Linux;
:mod:`.shm` imports everywhere and refuses to run elsewhere.
"""

from typing import Any

from .._platform import SAME_HOST_ENGINE

#: whether this platform has the engine (Linux); elsewhere only :mod:`.shm` imports, and refuses
AVAILABLE = SAME_HOST_ENGINE

if AVAILABLE:
    from ._comm import ABI_VERSION, CAPSULE_NAME, CLOSED, FAILED, INVALID, MISMATCH, OK, TIMEOUT
    from ._steps import header_hash
    from .rings import RingMesh
    from .segment import Engine


def comm_capsule(backend: Any) -> Any:
    """``backend``'s engine communicator for a C or C++ client: a capsule named
    ``ferro_backend.engine.comm`` whose pointer is a ``ferro_comm*`` (``ferro/engine.h``, under
    :func:`ferro_backend.get_include`), with a reference of its own that the capsule releases.

    Raises
    ------
    RuntimeError
        ``backend`` has no engine: not a :class:`~ferro_backend.ShmBackend` (or one with the
        engine off), or a platform without one.
    """
    engine = getattr(backend, "engine", None)
    if engine is None:
        raise RuntimeError(f"comm_capsule: {type(backend).__name__} (rank {backend.rank} of "
                           f"{backend.world_size}) has no same-host engine; a ShmBackend with "
                           "the engine on has one")
    return engine.capsule()


__all__ = ["ABI_VERSION", "AVAILABLE", "CAPSULE_NAME", "CLOSED", "FAILED", "INVALID", "MISMATCH",
           "OK", "TIMEOUT", "Engine", "RingMesh", "comm_capsule", "header_hash"]
