"""Building a group's ferro transport through the store torch hands the backend creator.

torch's TCPStore (torchrun, ferrorun, ``tcp://``) already holds MASTER_PORT, so ferro's mesh
never binds it: every rank posts where it runs, rank 0 picks a free port and posts its address,
and every rank reads that address back from the store. The transport is picked like
``ferro_backend.init_from_env``: the shared-memory engine (:class:`ShmBackend`) when every rank
of the group runs on this host, TCP otherwise; ``FERRO_TRANSPORT`` (``tcp`` or ``shm``)
overrides. The mesh is authenticated with ``FERRO_TOKEN`` (never sent through the store, which
is not).
"""

from __future__ import annotations

import inspect
import os
import socket
from pathlib import Path

from ferro_backend import Backend, ShmBackend, TcpBackend, settings
from ferro_backend._platform import SAME_HOST_ENGINE

TRANSPORTS = ("tcp", "shm")


def _host_id() -> str:
    """This machine: the host name and the kernel's boot id (containers of one host that share
    a kernel but not a name count as different hosts: shared memory may not reach across)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _reachable_host(store) -> str:
    """Where the other hosts can reach rank 0: MASTER_ADDR, else the TCPStore's host, else
    this host's name."""
    addr = os.environ.get("MASTER_ADDR")
    if addr:
        return addr
    while store is not None:
        host = getattr(store, "host", None)
        if host:
            return host
        store = getattr(store, "underlying_store", None)
    return socket.gethostname()


def _takes_listener(cls) -> bool:
    try:
        return "listener" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def _bind(host: str, world_size: int, keep: bool) -> tuple[socket.socket | None, int]:
    """A port on ``host`` for rank 0's rendezvous: the listening socket itself when the
    transport takes one over (no race for the port), else a port that was free a moment ago."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
        if keep:
            sock.listen(max(16, world_size))
            return sock, port
    except BaseException:
        sock.close()
        raise
    sock.close()
    return None, port


def transport_name(one_host: bool) -> str:
    """``FERRO_TRANSPORT`` when set, else ``shm`` on one Linux host and ``tcp`` otherwise."""
    name = settings.TRANSPORT.get()
    if name is not None:
        if name not in TRANSPORTS:
            raise ValueError(f"FERRO_TRANSPORT {name!r} is not one of {TRANSPORTS} under "
                             "ferro-torch")
        return name
    return "shm" if one_host and SAME_HOST_ENGINE else "tcp"


def connect(store, rank: int, world_size: int, timeout: float) -> Backend:
    """This rank's ferro transport for a group of ``world_size`` ranks whose torch store is
    ``store`` (each group's store has a prefix of its own)."""
    store.set(f"ferro/host/{rank}", _host_id())
    hosts = {store.get(f"ferro/host/{r}").decode() for r in range(world_size)}
    name = transport_name(len(hosts) == 1)
    cls = ShmBackend if name == "shm" else TcpBackend
    kwargs: dict = {"timeout": timeout}
    if rank == 0:
        host = "127.0.0.1" if len(hosts) == 1 else _reachable_host(store)
        listener, port = _bind(host, world_size, keep=world_size > 1 and _takes_listener(TcpBackend))
        if listener is not None:
            kwargs["listener"] = listener
        store.set("ferro/addr", f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    addr = store.get("ferro/addr").decode()
    return cls(rank, world_size, addr, **kwargs)


__all__ = ["TRANSPORTS", "connect", "transport_name"]
