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

from __future__ import annotations

import sys
from typing import Any

#: whether this platform has the engine: Linux (cross-memory attach, memfd, futexes). There its
#: compiled kernels are imported with the package, unconditionally (a broken build fails
#: loudly); elsewhere they are not built, only :mod:`.shm` imports (and refuses to run), and
#: ``ferrorun`` defaults to TCP.
AVAILABLE = sys.platform.startswith("linux")

if AVAILABLE:
    from . import _calls, _comm, _ring, _segment, _steps, _watch  # noqa: F401
    from ._comm import ABI_VERSION, CAPSULE_NAME, CLOSED, FAILED, INVALID, MISMATCH, OK, TIMEOUT
    from ._steps import header_hash
    from .rings import RingMesh
    from .segment import Engine


def attach_engine(group: Any, slot_bytes: int | None = None) -> Engine:
    """Give ``group`` (a :class:`~ferro_backend.SubBackend` whose members share a host: a
    subgroup of a :class:`~ferro_backend.ShmBackend`, or of one node of a multi-node job) an
    engine of its own, as ``group.engine``, and return it: ferro-collective's collectives on the
    group then run on it, and :func:`comm_capsule` hands it to a C or C++ client (a torch
    subgroup, a JAX handler). Collective over ``group``: every member calls it. Its waits end
    when one of the members fails; it closes with the root transport.

    Raises
    ------
    ValueError
        The members are on several hosts (``root.nodes`` says so).
    RuntimeError
        A platform without the engine.
    RendezvousError
        Setting up the segment failed (naming the rank and why).
    """
    if not AVAILABLE:
        raise RuntimeError("attach_engine: this platform has no same-host engine (Linux only)")
    root = getattr(group, "root", group)
    members = getattr(group, "global_ranks", tuple(range(group.world_size)))
    nodes = getattr(root, "nodes", None)
    if nodes is not None and len({nodes[r] for r in members}) > 1:
        raise ValueError(f"attach_engine: the members {list(members)} are on several hosts "
                         f"({sorted({nodes[r] for r in members})})")
    # (within the job's connect_timeout too, not a call's alone: see ShmBackend)
    setup = max(group.timeout, getattr(root, "connect_timeout", 0.0) or 0.0)
    engine = group.engine = Engine.join(group, slot_bytes=slot_bytes, timeout=setup)

    def on_failure() -> None:
        # a member gone, an abort, this rank closing: every wait ends now; a rank outside the
        # group that finished and closed does not break the group's calls
        failures = [f for f in (root.peer_failure("engine", p) for p in members)
                    if f is not None]
        if failures:
            engine.mark_failed(str(failures[0]))

    if hasattr(root, "on_failure"):
        root.on_failure(on_failure)
    if hasattr(root, "on_close"):
        root.on_close(engine.close)
    return engine


def comm_capsule(backend: Any) -> Any:
    """``backend``'s engine communicator for a C or C++ client: a capsule named
    ``ferro_backend.engine.comm`` whose pointer is a ``ferro_comm*`` (``ferro/engine.h``, under
    :func:`ferro_backend.get_include`), with a reference of its own that the capsule releases.

    Raises
    ------
    RuntimeError
        ``backend`` has no engine: not a :class:`~ferro_backend.ShmBackend` (or one with the
        engine off), nor a subgroup given one (:func:`attach_engine`), or a platform without
        one.
    """
    engine = getattr(backend, "engine", None)
    if engine is None:
        raise RuntimeError(f"comm_capsule: {type(backend).__name__} (rank {backend.rank} of "
                           f"{backend.world_size}) has no same-host engine; a ShmBackend with "
                           "the engine on has one")
    return engine.capsule()


__all__ = ["ABI_VERSION", "AVAILABLE", "CAPSULE_NAME", "CLOSED", "FAILED", "INVALID", "MISMATCH",
           "OK", "TIMEOUT", "Engine", "RingMesh", "attach_engine", "comm_capsule", "header_hash"]
