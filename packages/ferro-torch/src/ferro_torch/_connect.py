"""Building a group's ferro transport through the store torch hands the backend creator.

torch's TCPStore (torchrun, ferrorun, ``tcp://``) already holds MASTER_PORT, so ferro's mesh
never binds it: the ranks meet through the store exactly as ``ferro_backend.init_from_env``
does under torchrun (``ferro_backend.joining.meet.via_store``: one rendezvous, one rule for the
transport, one definition of a node), so the shared-memory engine (:class:`ShmBackend`) serves a
group whose ranks all run on this host and TCP any other. ``FERRO_TRANSPORT`` (``tcp`` or
``shm``; ``mpi`` is not a ferro-torch transport) overrides. The mesh is authenticated with
``FERRO_TOKEN`` (never sent through the store, which is not).
"""

from __future__ import annotations

from ferro_backend import Backend, settings
from ferro_backend.joining.meet import node_key, via_store

#: the FERRO_TRANSPORT values a ferro group can be built on
TRANSPORTS = ("tcp", "shm")


def _store_address(store) -> tuple[str, int] | None:
    """The TCPStore's (host, port) under any prefix/wrapper stores, if it has one."""
    while store is not None:
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if host and port:
            return host, int(port)
        store = getattr(store, "underlying_store", None)
    return None


def connect(store, rank: int, world_size: int, timeout: float) -> Backend:
    """This rank's ferro transport for a group of ``world_size`` ranks whose torch store is
    ``store`` (each group's store has a prefix of its own)."""
    requested = settings.TRANSPORT.get()
    if requested is not None and requested not in TRANSPORTS:
        raise ValueError(f"FERRO_TRANSPORT {requested!r} is not one of {TRANSPORTS} under "
                         "ferro-torch")
    return via_store(store, rank, world_size, node_key(settings.NODE_ID.get()), requested,
                     {"timeout": timeout}, toward=_store_address(store), where="torch's store")


__all__ = ["TRANSPORTS", "connect"]
