"""Joining a job: the transport its topology allows, and how its ranks meet. Written once.

Once :mod:`.detect` has said which launcher started this process, ``connect`` (:mod:`.env`)
builds this rank's backend with what this module offers:

* **the transport** (:func:`choose_transport`, the one rule): the same-host engine
  (:class:`~ferro_backend.ShmBackend`) when every rank is on one host, TCP across hosts, with a
  :class:`~ferro_backend.hierarchy.Hierarchy` on several nodes (the engine inside each node,
  TCP between them; ``FERRO_HIERARCHY=0`` turns it off); ``FERRO_TRANSPORT`` overrides;
* **a node** (:func:`node_key`, the one definition): the host name and the kernel's boot id
  (containers of one host that share a kernel but not a name are different hosts: shared memory
  may not reach across), with the launcher's node id (``GROUP_RANK``, ``SLURM_NODEID``) or
  ``FERRO_NODE_ID`` where there is one; two ranks share a node only if their keys are equal;
* **the rendezvous**: rank 0 listens on ``MASTER_ADDR:MASTER_PORT`` (ferrorun); a store
  (:func:`via_store`: torchrun's TCPStore, and the store torch hands ferro-torch's backend);
  MPI (:mod:`.mpi_meet`); Slurm's variables (a port derived from the job and step ids).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from .. import settings
from ..base import DEFAULT_TIMEOUT, Backend
from ..checks import wait_limit
from ..engine import AVAILABLE as SAME_HOST_ENGINE
from ..engine.shm import ShmBackend
from ..errors import LauncherError, RendezvousError
from ..mesh.rendezvous import listen
from ..mesh.tcp import TcpBackend
from .detect import Launcher

#: the tag of the node-key exchange over a freshly built mesh (ferro's own tag range)
NODES_TAG = (1 << 32) - 5
_KEY_BYTES = 512


def node_key(node_id: str | None = None) -> str:
    """This rank's node as ranks compare it (see the module docstring)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    key = f"{socket.gethostname()}/{boot}"
    return key if node_id is None else f"{key}/{node_id}"


def choose_transport(requested: str | None, one_host: bool, where: str) -> str:
    """``requested`` (FERRO_TRANSPORT) checked against the topology, or the fastest one: the
    engine on one Linux host, TCP otherwise. ``where`` names the job in the error."""
    if requested is None:
        return "shm" if one_host and SAME_HOST_ENGINE else "tcp"
    if requested == "shm" and not one_host:
        raise LauncherError(f"init_from_env: FERRO_TRANSPORT=shm needs every rank on one host; "
                            f"{where}: use tcp or mpi")
    return requested


def build(transport: str, rank: int, world: int, addr: str, kwargs: dict[str, Any],
          listener: socket.socket | None = None) -> Backend:
    """The backend of ``transport`` (tcp or shm) for rank ``rank`` of ``world`` at ``addr``."""
    cls = ShmBackend if transport == "shm" else TcpBackend
    return cls(rank, world, addr, listener=listener, **kwargs)


def exchange_nodes(backend: Backend, key: str) -> list[str]:
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
            backend.recv(buf, peer, tag=NODES_TAG, timeout=backend.timeout)
            keys[peer] = bytes(buf).rstrip(b"\0").decode(errors="replace")
    return keys


def address(addr: str, port: int) -> str:
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


def listen_for_job(nodes: list[str], env: Mapping[str, str] | None, world: int,
                   toward: tuple[str, int] | None = None) -> tuple[socket.socket, str]:
    """Rank 0: bind the rendezvous listener (FERRO_MASTER_PORT, else any free port: nothing to
    collide with) and return it with the ``host:port`` the other ranks must connect to."""
    port = settings.MASTER_PORT.get(env) or 0
    if len(set(nodes)) == 1:  # one host: loopback only
        lsock = listen("127.0.0.1", port, 0, world)
        return lsock, address("127.0.0.1", lsock.getsockname()[1])
    adv = settings.MASTER_ADDR.get(env) or _own_address(toward)
    lsock = listen("::" if ":" in adv else "0.0.0.0", port, 0, world)
    return lsock, address(adv, lsock.getsockname()[1])


def _failure(exc: BaseException) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}",
            "kind": "launcher" if isinstance(exc, LauncherError) else "rendezvous"}


def raise_for(info: dict[str, Any], rank: int) -> None:
    """Raise rank 0's set-up failure, as rank 0 published it, on another rank."""
    if "error" in info:
        cls = LauncherError if info.get("kind") == "launcher" else RendezvousError
        raise cls(f"rank {rank}: rank 0 could not set up the job: {info['error']}")


def publish_setup(nodes: list[str], requested: str | None, env: Mapping[str, str] | None,
                  world: int, toward: tuple[str, int] | None = None,
                  ) -> tuple[socket.socket | None, dict[str, Any], BaseException | None]:
    """Rank 0 of a job whose ranks published their node keys: the listener, what the other
    ranks need (``addr``, ``transport``, ``nodes``), and None; or None, the failure to tell
    them, and the error for rank 0 to raise once it has told them."""
    try:
        one = len(set(nodes)) == 1
        chosen = choose_transport(requested, one, f"this job's ranks are on {len(set(nodes))} "
                                                  f"nodes ({', '.join(sorted(set(nodes)))})")
        listener, addr = listen_for_job(nodes, env, world, toward)
    except Exception as exc:
        return None, _failure(exc), exc
    return listener, {"addr": addr, "transport": chosen, "nodes": nodes}, None


def via_store(store, rank: int, world: int, node: str, requested: str | None,
              kwargs: dict[str, Any], *, prefix: str = "ferro/", env=None,
              toward: tuple[str, int] | None = None, where: str = "the store") -> Backend:
    """Meet through a torch store (``set``/``get``; ``get`` waits for the key): every rank
    publishes its node, rank 0 picks the transport, binds a fresh listener (no port is guessed,
    so none collides with the store, another job or an ephemeral connection) and publishes
    ``{addr, transport, nodes}``; the others read it and connect. ``prefix`` keeps the keys of
    one rendezvous apart from every other's in that store; ``where`` names the store in errors.
    """

    def get(key: str, missing: str) -> bytes:
        try:
            return store.get(key)
        except Exception as exc:  # the store's own error: a timeout, a lost connection
            raise RendezvousError(f"rank {rank}: {where}: {missing}: {exc}") from exc

    store.set(f"{prefix}node/{rank}", node)
    listener = None
    if rank == 0:
        nodes = [get(f"{prefix}node/{r}", "not every rank published its node").decode()
                 for r in range(world)]
        listener, info, error = publish_setup(nodes, requested, env, world, toward)
        store.set(f"{prefix}master", json.dumps(info))
        if error is not None:
            raise error
    else:
        info = json.loads(get(f"{prefix}master", "rank 0 published no address"))
    raise_for(info, rank)
    backend = build(info["transport"], rank, world, info["addr"], kwargs, listener)
    backend.nodes = tuple(info["nodes"])
    return backend


def via_master(launcher: Launcher, transport: str | None, kwargs: dict[str, Any]) -> Backend:
    """ferrorun (or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT by hand): rank 0 listens on
    MASTER_ADDR:MASTER_PORT, TCP unless FERRO_TRANSPORT (ferrorun sets it) says otherwise."""
    key = node_key(launcher.node_id)
    # the node keys travel in the rendezvous's table: no exchange over the mesh afterwards
    # (which would connect every pair of a lazy mesh)
    backend = (ShmBackend if transport == "shm" else TcpBackend).from_env(**kwargs, node=key)
    if launcher.num_nodes == 1:
        backend.nodes = (key,) * launcher.world_size
    return backend


_store_joins = 0  # init_from_env calls under torchrun in this process: fresh keys each time


def via_torch_store(launcher: Launcher, transport: str | None, env: Mapping[str, str],
                     kwargs: dict[str, Any]) -> Backend:
    """torchrun: its agent's TCPStore listens on MASTER_ADDR:MASTER_PORT (which is why binding
    that port fails), so the ranks meet through it (:func:`via_store`). Keys are namespaced by
    the run id, the restart count and the call, so a restarted job never reads a stale address.

    Without torch importable (a torchrun from another environment) ferro cannot talk to the
    store, and any port derived from MASTER_PORT could be held by another job, so we do not
    guess one: FERRO_MASTER_PORT names ferro's own port on MASTER_ADDR, else a clear error."""
    global _store_joins
    try:
        from torch.distributed import TCPStore
    except ImportError as exc:
        return _via_own_port(launcher, transport, env, kwargs, exc)
    timeout = kwargs.get("timeout", DEFAULT_TIMEOUT)
    host, port = launcher.master_addr, launcher.master_port
    _store_joins += 1
    prefix = (f"ferro/{env.get('TORCHELASTIC_RUN_ID', '')}/"
              f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_store_joins}/")
    where = f"torchrun's store at {host}:{port}"
    try:
        store = TCPStore(host, port, is_master=False,
                         timeout=timedelta(seconds=wait_limit(timeout)))
    except Exception as exc:  # the store's own errors (a timeout, a refused connection)
        raise RendezvousError(f"rank {launcher.rank}: {where}: {exc}") from exc
    try:
        return via_store(store, launcher.rank, launcher.world_size, node_key(launcher.node_id),
                         transport, kwargs, prefix=prefix, env=env, toward=(host, port),
                         where=where)
    finally:
        del store


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
    local_world = env.get("LOCAL_WORLD_SIZE", "").strip()
    one_host = launcher.num_nodes == 1 or local_world == str(launcher.world_size)
    chosen = choose_transport(transport, one_host, f"torchrun's ranks span "
                              f"{launcher.num_nodes or 'several'} nodes (GROUP_WORLD_SIZE, "
                              "LOCAL_WORLD_SIZE)")
    key = node_key(launcher.node_id)
    backend = build(chosen, launcher.rank, launcher.world_size,
                    address(launcher.master_addr, port), dict(kwargs, node=key))
    if backend.nodes is None:
        backend.nodes = tuple(exchange_nodes(backend, key))
    return backend


def via_slurm(launcher: Launcher, transport: str | None, env: Mapping[str, str],
              kwargs: dict[str, Any]) -> Backend:
    """srun: every rank knows rank 0's address (the first host of the step) and port (derived
    from the job and step ids) without talking; Slurm says how many nodes the step spans."""
    nodes = launcher.num_nodes
    chosen = choose_transport(transport, nodes == 1, f"this Slurm step spans "
                              f"{nodes or 'an unknown number of'} nodes (SLURM_STEP_NUM_NODES)")
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
    key = node_key(launcher.node_id)
    backend = build(chosen, launcher.rank, launcher.world_size, address(addr, port),
                    dict(kwargs, node=key), listener)
    if backend.nodes is None:
        backend.nodes = tuple(exchange_nodes(backend, key))
    return backend


__all__ = ["build", "choose_transport", "exchange_nodes", "listen_for_job", "node_key",
           "publish_setup", "raise_for", "via_master", "via_slurm", "via_store",
           "via_torch_store"]
