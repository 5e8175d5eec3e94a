"""Which launcher started this process, and what it says about this rank.

:func:`detect_launcher` reads the environment, in this order (the first launcher whose variables
are set wins; every other launcher's variables that are present must agree with it):

1. **ferrorun** (or anything that sets torchrun's four names ``RANK``, ``WORLD_SIZE``,
   ``MASTER_ADDR``, ``MASTER_PORT`` by hand): rank 0 listens on ``MASTER_ADDR:MASTER_PORT``,
   exactly as before this module existed (``FERRO_TRANSPORT``, which ferrorun sets, picks the
   transport).
2. **torchrun** (the four plus ``TORCHELASTIC_RUN_ID``; ``LOCAL_RANK``, ``GROUP_RANK``): torchrun's
   own TCPStore holds ``MASTER_PORT``, so the ranks meet *through that store*.
3. **Open MPI** (``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``) and 4. **MPICH / Intel MPI /
   Hydra** (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``): MPI itself (mpi4py) provides the
   rendezvous; without mpi4py a :class:`LauncherError` says what to install.
5. **Slurm srun** (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``, ``SLURM_LOCALID``,
   ``SLURM_NODEID``, ``SLURM_STEP_ID``): rank 0 listens on the first host of
   ``SLURM_STEP_NODELIST`` (parsed by python-hostlist) at a port derived from the job and step
   ids (:func:`slurm_port`) unless ``MASTER_ADDR``/``MASTER_PORT`` say otherwise.

No launcher variables: ``None``, and ``init_from_env`` runs the script as one rank.

What happens next (the transport, the rendezvous) is :mod:`.meet`'s.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .. import settings
from ..errors import LauncherError

#: ports derived from a Slurm job id lie in [SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN),
#: below Linux's ephemeral range (32768-60999), so no outgoing connection holds one by chance
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 12000
#: steps of one job that get distinct ports (steps 0..SLURM_STEPS-1; more wrap around)
SLURM_STEPS = 8

_LABELS = {"ferrorun": "ferrorun", "torchrun": "torchrun", "openmpi": "Open MPI (mpirun)",
           "mpich": "MPICH/Intel MPI/Hydra (mpiexec)", "slurm": "Slurm (srun)",
           "env": "RANK/WORLD_SIZE"}


@dataclass(frozen=True)
class Launcher:
    """What the launcher that started this process says about it (see :func:`detect_launcher`).

    ``node_id`` is the launcher's (or ``FERRO_NODE_ID``'s) name for this rank's node, None
    where only the host name tells; ``master_addr``/``master_port`` are where rank 0 listens,
    None where the rendezvous finds them (MPI, torchrun's store); ``num_nodes`` is None where
    the launcher does not say; ``seen`` lists the variables read, ``NAME=value``.

    Parameters
    ----------
    source : {"ferrorun", "torchrun", "openmpi", "mpich", "slurm"}
    rank, world_size, local_rank : int
        This process's rank, the job's size, and the rank's index on its node.
    node_id : str, optional
    master_addr : str, optional
    master_port : int, optional
    num_nodes : int, optional
    seen : tuple of str, default ()
    """

    source: str  # "ferrorun", "torchrun", "openmpi", "mpich" or "slurm"
    rank: int
    world_size: int
    local_rank: int
    node_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    num_nodes: int | None = None
    seen: tuple[str, ...] = field(default=(), compare=False)

    @property
    def label(self) -> str:
        """The launcher's name as messages give it ("torchrun", "Open MPI (mpirun)", "Slurm
        (srun)"...; the ``source`` itself for one without a label)."""
        return _LABELS.get(self.source, self.source)

    @property
    def is_mpi(self) -> bool:
        """Whether an MPI launcher started this rank (Open MPI's or MPICH/PMI's variables): the
        job may then join through MPI (``FERRO_TRANSPORT=mpi``)."""
        return self.source in ("openmpi", "mpich")


# ------------------------------------------------------------------------------ detection
def _int(env: Mapping[str, str], name: str) -> int:
    """``env[name]`` as a whole number >= 0 (a port for MASTER_PORT), else a LauncherError
    naming it. Plain ASCII digits only: ``int()`` also reads ``"1_0"`` (as 10), ``"+1"`` and
    other scripts' digits, none of which a launcher writes (a typo would pick another rank)."""
    raw = env[name]
    text = raw.strip()
    if not re.fullmatch(r"-?[0-9]+", text):
        raise LauncherError(f"init_from_env: {name}={raw!r} is not a whole number")
    value = int(text)
    if value < 0:
        raise LauncherError(f"init_from_env: {name}={raw!r} is negative")
    if name == "MASTER_PORT" and value > 65535:
        raise LauncherError(f"init_from_env: {name}={raw!r} is not a port (0-65535)")
    return value


def _opt_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if env.get(name, "").strip():
            return _int(env, name)
    return None


def _local_rank(env: Mapping[str, str], names: tuple[str, ...], world: int, world_name: str,
                size_name: str | None = None) -> int:
    """This rank's index on its node: the first of ``names`` set (0 when none is), which must
    lie below the node's rank count ``size_name`` (where set; itself at most the world size)
    and below the world size: a local rank past them picks a device or a core that is not
    this rank's, and the engine's slot of a rank that does not exist."""
    size = _opt_int(env, size_name) if size_name else None
    if size is not None and not 1 <= size <= world:
        raise LauncherError(f"init_from_env: {size_name}={size} ranks on this node but "
                            f"{world_name}={world} in the job: need 1 <= {size_name} <= "
                            f"{world_name}")
    name = next((n for n in names if env.get(n, "").strip()), None)
    if name is None:
        return 0
    local = _int(env, name)
    limit, limit_name = (size, size_name) if size is not None else (world, world_name)
    if local >= limit:
        raise LauncherError(f"init_from_env: {name}={local} but {limit_name}={limit}: the local "
                            f"rank must lie in [0, {limit})")
    return local


def _master(env: Mapping[str, str], world: int, addr: str | None = None) -> tuple[str, int]:
    """``MASTER_ADDR`` (or ``addr``) and ``MASTER_PORT``, where rank 0 listens: an empty
    address, or port 0 in a job of several ranks (rank 0 would listen on a port nobody knows,
    and the others dial port 0 until the connect timeout), is a LauncherError naming it."""
    addr = env["MASTER_ADDR"] if addr is None else addr
    if not addr.strip():
        raise LauncherError(f"init_from_env: MASTER_ADDR={addr!r} is empty: rank 0's address "
                            "is unknown (set it to rank 0's host)")
    port = _int(env, "MASTER_PORT")
    if port == 0 and world > 1:
        raise LauncherError(f"init_from_env: MASTER_PORT=0 in a job of {world} ranks: the "
                            "other ranks cannot reach rank 0 on port 0 (set the port rank 0 "
                            "listens on)")
    return addr, port


@dataclass(frozen=True)
class _Claim:
    """One launcher's (rank, world size) for this process, and the variables that say so."""

    source: str
    rank: int
    world: int
    names: tuple[str, str]

    def text(self) -> str:
        return (f"{self.names[0]}={self.rank}, {self.names[1]}={self.world} "
                f"({_LABELS[self.source]})")


def slurm_step(env: Mapping[str, str]) -> bool:
    """True in a task that ``srun`` started (a job step). The batch script of ``sbatch`` also
    has SLURM_PROCID=0 and SLURM_NTASKS, inherited by everything it runs (mpirun, ferrorun, a
    plain ``python``): those describe the batch step, not this process, and are ignored."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
    return "SLURM_PROCID" in env and step.isdigit() and bool(_slurm_tasks(env))


def _slurm_tasks(env: Mapping[str, str]) -> str:
    """The task count of an srun step as written (SLURM_STEP_NUM_TASKS, else SLURM_NTASKS; an
    empty one counts as unset), or ``""``."""
    return (env.get("SLURM_STEP_NUM_TASKS", "").strip() or env.get("SLURM_NTASKS", "").strip())


#: the variables a launcher sets together: one of a pair alone is half a launcher's environment
_PAIRS = (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
          ("PMI_RANK", "PMI_SIZE"))


def _claims(env: Mapping[str, str]) -> dict[str, _Claim]:
    for pair in _PAIRS:
        present = [k for k in pair if k in env]
        if len(present) == 1:
            (have,) = present
            (missing,) = [k for k in pair if k not in env]
            raise LauncherError(
                f"init_from_env: {have}={env[have]} is set but {missing} is not: half a "
                f"launcher's environment (set both, unset {have}, or start the job with "
                "ferrorun, torchrun, mpirun or srun)")
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
    if env.get("SLURM_PROCID", "").strip() and not _slurm_tasks(env) and (
            step or env["SLURM_PROCID"].strip() != "0"):
        # an srun task (a step, or a task other than the first) that does not say how many
        # tasks there are: running as a lone rank 0 would hide the mistake (as for the pairs)
        raise LauncherError(
            f"init_from_env: SLURM_PROCID={env['SLURM_PROCID']} is set but neither "
            "SLURM_NTASKS nor SLURM_STEP_NUM_TASKS is: the job's size is unknown (set "
            "SLURM_NTASKS, unset SLURM_PROCID, or start the job with srun)")
    procid = env.get("SLURM_PROCID", "").strip()
    if procid and procid != "0" and not slurm_step(env):
        # a task other than the first, yet no srun step: the batch script (the one place
        # SLURM_PROCID and SLURM_NTASKS come without a step) is task 0, so these were copied
        # or set by hand; as a lone rank 0 the job would run N copies of itself
        step_name = "SLURM_STEPID" if "SLURM_STEPID" in env and "SLURM_STEP_ID" not in env \
            else "SLURM_STEP_ID"
        tasks = ", ".join(f"{k}={env[k]}" for k in ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")
                          if env.get(k, "").strip())
        step_text = (f"{step_name}={env[step_name]!r} is not a step number"
                     if step_name in env else f"{step_name} is not set")
        raise LauncherError(
            f"init_from_env: SLURM_PROCID={env['SLURM_PROCID']} ({tasks}) but {step_text}: "
            "not an srun task, and not the batch script (task 0); unset the SLURM_ "
            "variables copied from another job, or start the job with srun")
    claims: dict[str, _Claim] = {}
    if "RANK" in env and "WORLD_SIZE" in env:
        claims["env"] = _Claim("env", _int(env, "RANK"), _int(env, "WORLD_SIZE"),
                               ("RANK", "WORLD_SIZE"))
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        claims["openmpi"] = _Claim("openmpi", _int(env, "OMPI_COMM_WORLD_RANK"),
                                   _int(env, "OMPI_COMM_WORLD_SIZE"),
                                   ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        claims["mpich"] = _Claim("mpich", _int(env, "PMI_RANK"), _int(env, "PMI_SIZE"),
                                 ("PMI_RANK", "PMI_SIZE"))
    if slurm_step(env):
        world = ("SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS", "").strip()
                 else "SLURM_NTASKS")
        claims["slurm"] = _Claim("slurm", _int(env, "SLURM_PROCID"), _int(env, world),
                                 ("SLURM_PROCID", world))
    for c in claims.values():
        if c.world < 1 or c.rank >= c.world:
            raise LauncherError(f"init_from_env: {c.text()}: the rank must lie in "
                                f"[0, {c.world}) and the world size be at least 1")
    return claims


def _check_agreement(primary: _Claim, claims: dict[str, _Claim]) -> None:
    """Every other launcher's claim must describe the same process, or an outer launcher that
    started the primary one (``srun -N 2 torchrun --nproc-per-node 4``: SLURM_NTASKS=2 divides
    WORLD_SIZE=8; ``mpirun`` under Slurm starts its daemons with srun, so the ranks see the
    daemons' step). Anything else (a stale ``export RANK=0`` in a job script...) is an error."""
    for other in claims.values():
        if other.source == primary.source:
            continue
        if other.world == primary.world:
            if other.rank == primary.rank:
                continue
        elif other.source == "env":
            pass  # RANK/WORLD_SIZE without MASTER_ADDR/PORT started nothing: stale, not outer
        elif other.world < primary.world and primary.world % other.world == 0:
            continue  # an outer launcher that started the primary one, a few per task
        elif primary.source in ("openmpi", "mpich") and other.source == "slurm":
            continue  # mpirun's daemons' srun step: as many tasks as nodes
        raise LauncherError(
            f"init_from_env: the launchers' variables disagree: {primary.text()} but "
            f"{other.text()}; unset the stale ones (an `export RANK=...` in a job script, "
            f"variables copied from another job) or start the job with one launcher")


def detect_launcher(environ: Mapping[str, str] | None = None) -> Launcher | None:
    """The launcher that started this process, from its environment; None outside a launcher.

    Parameters
    ----------
    environ : mapping of str to str, optional
        The environment to read (default: ``os.environ``).

    Returns
    -------
    Launcher or None

    Raises
    ------
    LauncherError
        Variables that are not numbers, a rank outside the world, launchers' variables that
        disagree (``RANK`` vs ``SLURM_PROCID``, ``WORLD_SIZE`` vs ``OMPI_COMM_WORLD_SIZE``...),
        half a launcher's pair (``RANK`` without ``WORLD_SIZE`` or the other way round, the same
        for Open MPI's and PMI's), ``RANK``/``WORLD_SIZE`` of a multi-rank job without
        ``MASTER_ADDR``/``MASTER_PORT``, or a Slurm task other than the first
        (``SLURM_PROCID`` > 0) outside an srun step (no ``SLURM_STEP_ID``).

    Examples
    --------
    >>> detect_launcher({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
    ...                  "MASTER_PORT": "29500"}).source
    'ferrorun'
    """
    env = os.environ if environ is None else environ
    claims = _claims(env)
    override = settings.NODE_ID.get(env)
    generic = "env" in claims and "MASTER_ADDR" in env and "MASTER_PORT" in env
    if generic:
        source = "torchrun" if env.get("TORCHELASTIC_RUN_ID") else "ferrorun"
        primary = claims["env"]
    else:
        source = next((s for s in ("openmpi", "mpich", "slurm") if s in claims), None)
        if source is None:
            c = claims.get("env")
            if c is not None and c.world > 1:
                missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
                raise LauncherError(
                    f"init_from_env: {c.text()} but {' and '.join(missing)} unset: rank 0's "
                    "address is unknown (set both, or start the job with ferrorun, torchrun, "
                    "mpirun or srun)")
            return None
        primary = claims[source]
    _check_agreement(primary, claims)
    seen = tuple(f"{k}={env[k]}" for k in _SEEN[source] if k in env)
    if source == "ferrorun":
        local_world = _opt_int(env, "LOCAL_WORLD_SIZE")
        nodes = (primary.world // local_world if local_world and primary.world % local_world == 0
                 else None)
        # ferrorun --nnodes sets GROUP_RANK (its --node-rank): the node id
        group = env.get("GROUP_RANK", "").strip() or None
        local = _local_rank(env, ("LOCAL_RANK",), primary.world, "WORLD_SIZE",
                            "LOCAL_WORLD_SIZE")
        return Launcher(source, primary.rank, primary.world, local, override or group,
                        *_master(env, primary.world), nodes, seen)
    if source == "torchrun":
        group = env.get("GROUP_RANK", "").strip() or None
        local = _local_rank(env, ("LOCAL_RANK",), primary.world, "WORLD_SIZE",
                            "LOCAL_WORLD_SIZE")
        return Launcher(source, primary.rank, primary.world, local, override or group,
                        *_master(env, primary.world), _opt_int(env, "GROUP_WORLD_SIZE"), seen)
    if source == "openmpi":
        local = _local_rank(env, ("OMPI_COMM_WORLD_LOCAL_RANK",), primary.world,
                            "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
        return Launcher(source, primary.rank, primary.world, local, override, seen=seen)
    if source == "mpich":
        # srun --mpi=pmi2 sets PMI_RANK but no MPI_LOCALRANKID: SLURM_LOCALID, same process
        same = "slurm" in claims and claims["slurm"].world == primary.world
        slurm_local = ("SLURM_LOCALID",) if same else ()
        local = _local_rank(env, ("MPI_LOCALRANKID", "PMI_LOCAL_RANK", *slurm_local),
                            primary.world, "PMI_SIZE")
        return Launcher(source, primary.rank, primary.world, local, override, seen=seen)
    # Slurm srun
    num_nodes = _opt_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if num_nodes == 0:
        name = next(n for n in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
                    if env.get(n, "").strip())
        raise LauncherError(f"init_from_env: {name}={env[name]!r}: a step of "
                            f"{primary.world} task(s) runs on at least one node")
    if env.get("MASTER_ADDR", "").strip():
        addr = env["MASTER_ADDR"].strip()
    elif num_nodes == 1:
        addr = "127.0.0.1"
    else:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        if not nodelist.strip():
            extra = (f" (SLURM_NODELIST={env['SLURM_NODELIST']!r} is not read: it does not say "
                     "which of the job's nodes run this step)"
                     if env.get("SLURM_NODELIST", "").strip() else "")
            raise LauncherError("init_from_env: Slurm srun variables but neither "
                                "SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST" + extra + ": rank "
                                "0's host is unknown (set SLURM_STEP_NODELIST or MASTER_ADDR)")
        addr = first_host(nodelist)
    port = _master(env, primary.world, addr)[1] if env.get("MASTER_PORT", "").strip() else None
    if port is None:
        port = settings.MASTER_PORT.get(env)
    if port is None:
        port = slurm_port(env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", "0")),
                          env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0")))
    node = override or (env.get("SLURM_NODEID", "").strip() or None)
    # (one node: every task of the step is on it, so SLURM_LOCALID < the task count)
    local = _local_rank(env, ("SLURM_LOCALID",), primary.world, primary.names[1])
    return Launcher(source, primary.rank, primary.world, local, node, addr, port, num_nodes,
                    seen)


_SEEN = {
    "ferrorun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"),
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
              "SLURM_NODEID", "SLURM_STEP_NODELIST", "SLURM_JOB_ID", "SLURM_STEP_ID"),
}


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list (``"cn[01-04,07],gpu2"`` -> ``"cn01"``), parsed by
    python-hostlist (the maintained parser of Slurm's compressed syntax)."""
    import hostlist

    try:
        hosts = hostlist.expand_hostlist(nodelist.strip())
    except hostlist.BadHostlist as exc:
        raise LauncherError(f"init_from_env: cannot parse the Slurm host list {nodelist!r}: "
                            f"{exc}") from exc
    if not hosts:
        raise LauncherError(f"init_from_env: the Slurm host list {nodelist!r} is empty")
    return hosts[0]


def slurm_port(job_id: str, step_id: str) -> int:
    """Rank 0's port for a Slurm job step: ``SLURM_PORT_BASE + (job * SLURM_STEPS + step %
    SLURM_STEPS) % SLURM_PORT_SPAN``. Every rank computes the same port without talking, and two
    steps running at once on one node never share it unless their job ids are a multiple of
    ``SLURM_PORT_SPAN / SLURM_STEPS`` (1500) apart; MASTER_PORT (or FERRO_MASTER_PORT)
    overrides it."""
    job = int(re.sub(r"\D", "", job_id) or 0)
    step = int(step_id) if step_id.strip().isdigit() else 0
    return SLURM_PORT_BASE + (job * SLURM_STEPS + step % SLURM_STEPS) % SLURM_PORT_SPAN


__all__ = ["Launcher", "detect_launcher", "first_host", "slurm_port"]
