"""Where a collective started in the background runs: on another thread, or at once in the
caller's thread. The background pays off when a core is free for that thread; when the ranks
of this host already fill its cores, the thread takes its core from the caller's own work
(a model's compute) and the two time-slice one core. ``FERRO_BACKGROUND`` (``auto``, ``on``,
``off``) decides for ferro-fsdp's DDP and FSDP and for ferro-torch's asynchronous collectives:
``auto`` runs them in the background only when this host has a core to spare beyond its
ranks.
"""

from __future__ import annotations

import os
from typing import Any

from ferro_backend import settings
from ferro_backend.engine import binding


def ranks_on_this_host(backend: Any) -> int | None:
    """How many ranks of ``backend``'s job run on this host, where the backend can tell (its
    node's share of a multi-node job, the ranks of its shared-memory engine, or the launcher's
    ``LOCAL_WORLD_SIZE``; more where emulated nodes share the host: ``FERRO_HOST_RANKS``);
    None where it cannot (a simulated network's threads)."""
    root = backend
    while getattr(root, "parent", None) is not None:  # a subgroup: its whole job counts
        root = root.parent
    hierarchy = getattr(root, "hierarchy", None)
    if hierarchy is not None:
        return binding.host_ranks(int(hierarchy.local_world))
    engine = getattr(root, "engine", None)
    if engine is not None:
        return binding.host_ranks(int(engine.nranks))
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return binding.host_ranks(int(local)) if local.isdigit() and int(local) > 0 else None


def usable_cores() -> int:
    """How many cores this process may run on (the engine's binding's list where the platform
    tells, else the machine's count)."""
    return len(binding.usable_cores()) or os.cpu_count() or 1


def runs_in_background(backend: Any, background: bool | None) -> bool:
    """Whether a wrapper on ``backend`` starts its collectives in the background:
    ``background`` when given, else ``FERRO_BACKGROUND`` (auto: unless the ranks on this host
    fill its cores).

    Parameters
    ----------
    backend : ferro_backend.Backend
    background : bool or None

    Returns
    -------
    bool

    Raises
    ------
    TypeError
        ``background`` is neither a bool nor None.
    """
    if background is not None:
        if not isinstance(background, bool):
            raise TypeError(f"background={background!r}: expected True, False or None")
        return background
    mode = settings.BACKGROUND.get()
    if mode != "auto":
        return mode == "on"
    local = ranks_on_this_host(backend)
    return local is None or local < usable_cores()


__all__ = ["ranks_on_this_host", "runs_in_background", "usable_cores"]
