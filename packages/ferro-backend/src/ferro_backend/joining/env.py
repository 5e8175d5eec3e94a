"""Pick the backend the environment asks for: the launcher's job, or one rank outside a launcher.

Which launcher started this process is :mod:`.detect`'s, how its ranks meet :mod:`.meet`'s;
this module keeps the public entry point and the logging set-up.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from .. import settings, timeline
from ..base import Backend
from ..checks import timeout_from_env
from ..hierarchy import attach_hierarchy
from ..mesh.tcp import TcpBackend
from ..simulated import SimulatedBackend
from . import mpi_meet
from .detect import Launcher, detect_launcher
from .meet import exchange_nodes, node_key, via_master, via_slurm, via_torch_store

log = logging.getLogger("ferro_backend.launchers")

#: the loggers of ferro's packages, set by FERRO_LOG_LEVEL (``ferrorun --log-level``)
LOGGERS = ("ferro_backend", "ferro_collective", "ferro_fsdp", "ferro_checkpoint")


def configure_logging(environ: dict[str, str] | None = None) -> None:
    """Apply ``FERRO_LOG_LEVEL`` (debug, info, warning, error) to ferro's loggers, with a
    handler on stderr when the program has configured none. Called when ferro_backend is
    imported; a no-op without the variable."""
    level = settings.LOG_LEVEL.get(environ)
    if level is None:
        return
    value = logging.getLevelName(level.upper())
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    for name in LOGGERS:
        logging.getLogger(name).setLevel(value)


def init_from_env(**kwargs: Any) -> Backend:
    """Return this process's backend: join the job of the launcher that started it.

    Launchers, in this order (README: "Launchers"): ferrorun, torchrun, Open MPI's mpirun,
    MPICH/Intel MPI/Hydra's mpiexec, Slurm's srun (:func:`ferro_backend.detect_launcher`).
    The transport is the fastest the job's topology allows: :class:`ShmBackend` (the same-host
    engine) when every rank is on one host, :class:`TcpBackend` across hosts;
    ``FERRO_TRANSPORT=tcp|shm|mpi`` overrides (under ferrorun, which sets it, exactly as
    before). Rank 0 logs :meth:`Backend.describe` once at INFO. Outside any launcher: a
    one-rank backend, so the same script runs alone.

    Keyword arguments go to the backend's constructor. ``FERRO_TIMEOUT`` (``ferrorun
    --timeout``) sets :attr:`Backend.timeout`, the deadline of p2p calls and collectives alike,
    unless ``timeout=`` is given.

    Parameters
    ----------
    **kwargs
        Keyword arguments of the chosen backend's constructor (``timeout``, ``token``,
        ``connect``... of :class:`TcpBackend`/:class:`ShmBackend`), or of
        :meth:`SimulatedBackend.create_group` outside any launcher.

    Returns
    -------
    Backend
        This rank's backend (:class:`ShmBackend`, :class:`TcpBackend`, :class:`MpiBackend`, or a
        one-rank :class:`SimulatedBackend` outside any launcher); use it as a context manager.

    Raises
    ------
    LauncherError
        The launchers' variables disagree (``RANK`` vs ``SLURM_PROCID``...), or the launcher
        needs a package that is missing (mpi4py under mpirun): the message names the variables
        it saw and what to install. Never a silent one-rank run.
    RendezvousError, AuthenticationError
        The ranks could not meet (as :class:`TcpBackend`).
    SettingError
        A ``FERRO_*`` variable with an invalid value (``FERRO_TIMEOUT``, ``FERRO_TRANSPORT``,
        a ``FERRO_TRACE`` that is a file or cannot be created), before any connection.

    Examples
    --------
    >>> import numpy as np
    >>> from ferro_backend import init_from_env
    >>> with init_from_env() as backend:  # under ferrorun -n 2 / torchrun
    ...     if backend.rank == 0:
    ...         backend.send(np.arange(4.0), dst=1)
    ...     else:
    ...         out = np.empty(4)
    ...         backend.recv(out, src=0)
    """
    trace_dir = settings.TRACE.get()
    if trace_dir is not None and not timeline.active():
        timeline.check_env_dir(trace_dir)  # a path that cannot be written: said before joining
    launcher = detect_launcher()
    if launcher is not None:
        backend = connect(launcher, **kwargs)
    else:
        env_timeout = timeout_from_env()
        if env_timeout is not None:
            kwargs.setdefault("timeout", env_timeout)
        (backend,) = SimulatedBackend.create_group(1, **kwargs)
    if trace_dir is not None and not timeline.active():
        timeline.start_from_env(backend, trace_dir)
    return backend


def connect(launcher: Launcher, environ: Mapping[str, str] | None = None,
            **kwargs: Any) -> Backend:
    """Join the job ``launcher`` describes with the fastest transport its topology allows
    (``FERRO_TRANSPORT`` overrides); rank 0 logs :meth:`Backend.describe` at INFO.

    Raises
    ------
    LauncherError
        A dependency the launcher needs is missing (mpi4py under mpirun, torch or
        FERRO_MASTER_PORT under torchrun), ``FERRO_TRANSPORT=shm`` on several hosts, an MPI
        that disagrees with the launcher's variables.
    RendezvousError, AuthenticationError
        As :class:`TcpBackend`.
    """
    env = os.environ if environ is None else environ
    transport = settings.TRANSPORT.get(environ)
    env_timeout = timeout_from_env()
    if env_timeout is not None:
        kwargs.setdefault("timeout", env_timeout)
    if transport == "mpi" or launcher.is_mpi:
        backend = mpi_meet.connect(launcher, transport, env, kwargs)
    elif launcher.source == "ferrorun":
        backend = via_master(launcher, transport, kwargs)
    elif launcher.source == "torchrun":
        backend = via_torch_store(launcher, transport, env, kwargs)
    else:
        backend = via_slurm(launcher, transport, env, kwargs)
    if (transport is None and isinstance(backend, TcpBackend) or transport == "mpi") \
            and backend.world_size > 1 and settings.HIERARCHY.get(environ):
        # several nodes: the engine inside each node, the mesh (or MPI) between them
        if backend.nodes is None:
            backend.nodes = tuple(exchange_nodes(backend, node_key(launcher.node_id)))
        attach_hierarchy(backend)
    if launcher.rank == 0:
        log.info("init_from_env: started by %s\n%s", launcher.label, backend.describe())
    return backend


__all__ = ["LOGGERS", "configure_logging", "connect", "init_from_env"]
