"""``ShmBackend``: a job whose ranks share a host, on the same-host engine.

The TCP mesh (over loopback) stays the control plane: rendezvous, authentication, failure
detection and abort. The data moves through the job's engine (:mod:`.segment`, an anonymous
``memfd``: nothing has a name in ``/dev/shm``, so a SIGKILLed rank leaks nothing): collectives
through its slots (ferro-collective), point-to-point messages through its rings
(:class:`~.rings.RingMesh`, installed as the mesh's route to every peer). With the engine off
(``engine=False``, ``FERRO_SHM_ENGINE=0``) it is a TCP mesh over loopback.

Same contract and errors as :class:`~ferro_backend.TcpBackend`: a dead peer fails waiting
receives (and a send waiting for its receiver) at once, timeouts raise CollectiveTimeoutError,
``abort`` reaches everyone.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from .. import settings
from ..mesh.tcp import TcpBackend
from . import AVAILABLE as SAME_HOST_ENGINE


class ShmBackend(TcpBackend):
    """One rank of a job whose ranks share a host. Arguments as :class:`TcpBackend`, plus
    ``engine`` and ``slot_bytes``.

    Parameters
    ----------
    rank, world_size : int
        This process's rank and the number of processes.
    master_addr : str
        ``"host:port"`` where rank 0 listens for the rendezvous (loopback).
    engine : bool, optional
        Map the job's engine (:class:`ferro_backend.engine.Engine`), on which ferro-collective
        runs its collectives and point-to-point messages travel (default: on,
        ``FERRO_SHM_ENGINE=0`` turns it off).
    slot_bytes : int, optional
        Data bytes per rank and slot of the engine (default 1 MiB, ``FERRO_SHM_SLOT_BYTES``):
        collectives up to this size take one step.
    **kwargs
        The keyword arguments of :class:`TcpBackend`: ``timeout``, ``token``,
        ``connect_timeout``, ``listener``, ``node``, ``connect``.

    Raises
    ------
    RuntimeError
        Not on Linux (the engine needs ``process_vm_readv``, ``memfd`` and futexes).
    InvalidRankError, InvalidWorldSizeError, ValueError, RendezvousError, AuthenticationError
        As for :class:`TcpBackend`.

    Examples
    --------
    >>> import numpy as np
    >>> from ferro_backend import ShmBackend
    >>> # in each of 2 processes on one host, rank = 0 or 1:
    >>> with ShmBackend(rank, 2, "127.0.0.1:29500", timeout=30.0) as backend:
    ...     backend.barrier()
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, *,
                 engine: bool | None = None, slot_bytes: int | None = None,
                 **kwargs: Any) -> None:
        if not SAME_HOST_ENGINE:
            raise RuntimeError(f"ShmBackend needs Linux (process_vm_readv, memfd, futexes); this "
                               f"is {sys.platform}: use TcpBackend (ferrorun --transport tcp)")
        from .rings import RingMesh
        from .segment import Engine

        use_engine = settings.SHM_ENGINE.get() if engine is None else engine
        super().__init__(rank, world_size, master_addr, **kwargs)
        if world_size > 1 and use_engine:
            try:
                # (set up within connect_timeout too, not a call's alone: a short call timeout
                # must not fail the setup on a loaded host)
                self.engine = Engine.join(self, slot_bytes=slot_bytes,
                                          timeout=max(self.timeout, self.connect_timeout))
                self.on_close(self.engine.close)  # (run after the routes' close)
                self.on_close(self._drop_rings)
                self.on_failure(lambda: self.engine.mark_failed(self._failure_reason()))
                self.install_route(RingMesh(self.engine, self.mailbox, lambda: self.timeout))
            except BaseException:
                self.abort("the engine segment could not be set up")
                raise

    #: (bytes sent, bytes received) through the rings' route, kept when it is dropped at close
    _ring_bytes = (0, 0)

    def _drop_rings(self) -> None:
        """At close, after the route's own close: drop the (closed) rings' route, and with it its
        views of the segment, so the engine's pages are released (:meth:`Engine.close
        <ferro_backend.engine.segment.Engine.close>`) even while this backend is referenced.
        Later calls meet the closed mailbox, as they did on the route."""
        routes = self.routes()
        self._ring_bytes = (sum(r.bytes_sent for r in routes),
                            sum(r.bytes_received for r in routes))
        self._routes.clear()
        self._route_list.clear()

    def _failure_reason(self) -> str:
        """What the engine's door says when a peer's failure ends its waits: the first peer
        that died or aborted (else closed), in rank order."""
        failures = [f for f in (self.peer_failure("engine", p) for p in range(self.world_size)
                                if p != self.rank) if f is not None]
        dead = [f for f in failures if not getattr(f, "clean", False)]
        return str((dead or failures)[0]) if failures else ""

    @property
    def bytes_sent(self) -> int:  # type: ignore[override]
        """Payload bytes sent over the sockets, the rings, and by the engine's collectives."""
        return (super().bytes_sent + self._ring_bytes[0]
                + (0 if self.engine is None else self.engine.bytes_sent))

    @property
    def bytes_received(self) -> int:  # type: ignore[override]
        """Payload bytes received over the sockets, the rings, and by the engine's collectives."""
        return (super().bytes_received + self._ring_bytes[1]
                + (0 if self.engine is None else self.engine.bytes_received))

    def link_transports(self) -> tuple[str, str]:
        if self.engine is None:
            within = "TCP loopback (the engine is off)"
        else:
            routes = self.routes()  # (none once closed)
            big = ("streamed through the ring" if routes and routes[0].cma_threshold is None
                   else "cross-memory copy" if routes else "as the job chose")
            within = (f"shared-memory engine (collectives: {self.engine.slot_bytes >> 10} KiB "
                      f"slots; point-to-point: {self.engine.ring_bytes >> 10} KiB rings, "
                      f"large messages {big}), TCP loopback for control")
            link = self.engine.link
            if link is not None:
                within += (f"; at the last link probe, {link.describe()} (probe {link.probe} "
                           f"of this job, {max(0.0, time.time() - link.at):.0f} s ago)")
        return within, "none (ShmBackend needs every rank on one host)"


__all__ = ["ShmBackend"]
