"""Pick the backend the environment asks for: TCP under ferrorun/torchrun, one rank otherwise."""

from __future__ import annotations

import logging
import os
from typing import Any

from .base import Backend, timeout_from_env
from .shm import ShmBackend
from .simulated import SimulatedBackend
from .tcp import TcpBackend

#: the loggers of ferro's packages, set by FERRO_LOG_LEVEL (``ferrorun --log-level``)
FERRO_LOGGERS = ("ferro_backend", "ferro_collective", "ferro_fsdp", "ferro_checkpoint")


def configure_logging(environ: dict[str, str] | None = None) -> None:
    """Apply ``FERRO_LOG_LEVEL`` (debug, info, warning, error) to ferro's loggers, with a
    handler on stderr when the program has configured none. Called when ferro_backend is
    imported; a no-op without the variable."""
    level = (os.environ if environ is None else environ).get("FERRO_LOG_LEVEL")
    if not level:
        return
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise ValueError(f"FERRO_LOG_LEVEL {level!r} is not debug, info, warning or error")
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    for name in FERRO_LOGGERS:
        logging.getLogger(name).setLevel(value)


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
