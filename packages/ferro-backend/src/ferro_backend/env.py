"""Pick the backend the environment asks for: TCP under ferrorun/torchrun, one rank otherwise."""

from __future__ import annotations

import os
from typing import Any

from .base import Backend, timeout_from_env
from .shm import ShmBackend
from .simulated import SimulatedBackend
from .tcp import TcpBackend


def init_from_env(**kwargs: Any) -> Backend:
    """Return this process's backend.

    Under ``ferrorun`` (or torchrun), where RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set,
    a :class:`TcpBackend` joined to the job (:class:`ShmBackend` when FERRO_TRANSPORT=shm);
    otherwise a one-rank backend, so the same script runs alone.
    Keyword arguments go to the backend's constructor. ``FERRO_TIMEOUT`` (``ferrorun
    --timeout``) sets :attr:`Backend.timeout`, the deadline of p2p calls and collectives alike,
    unless ``timeout=`` is given.
    """
    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        if env.get("FERRO_TRANSPORT") == "shm":
            return ShmBackend.from_env(**kwargs)
        return TcpBackend.from_env(**kwargs)
    env_timeout = timeout_from_env()
    if env_timeout is not None:
        kwargs.setdefault("timeout", env_timeout)
    (backend,) = SimulatedBackend.create_group(1, **kwargs)
    return backend
