"""Routes: a faster way to some peers of a mesh backend than its sockets.

A :class:`~ferro_backend.TcpBackend` sends and receives through its sockets, except for the peers
a route was installed for (:meth:`TcpBackend.install_route`): their messages go through the
route, which keeps the backend's contract (FIFO per pair and tag, sends that never wait for the
receiver, SizeMismatchError, timeouts, failures through the backend's mailbox). The same-host
engine's rings are the route of ferro's own transports (:class:`ferro_backend.engine.RingMesh`):
every peer of a :class:`~ferro_backend.ShmBackend`, the ranks of this rank's node in a
multi-node job.
"""

from __future__ import annotations

import abc
from typing import Any

from ..base import Request


class Route(abc.ABC):
    """Point-to-point messages to and from :attr:`peers` (job ranks), on behalf of a mesh
    backend whose mailbox, timeout and failures it shares."""

    #: the job ranks this route carries messages to and from
    peers: frozenset[int]
    #: payload bytes sent / received through it
    bytes_sent: int = 0
    bytes_received: int = 0

    @abc.abstractmethod
    def send(self, data: Any, dst: int, tag: int) -> None:
        """Send ``data`` to ``dst`` (one of :attr:`peers`) on ``tag``: validate the buffer and
        the tag as :meth:`Backend.send` does, and raise what it raises."""

    @abc.abstractmethod
    def recv(self, out: Any, src: int, tag: int, timeout: float | None) -> None:
        """:meth:`Backend.recv` from ``src`` (one of :attr:`peers`), validating ``out``, the
        tag and the timeout."""

    @abc.abstractmethod
    def irecv(self, view: memoryview, src: int, tag: int) -> Request:
        """Post a receive into ``view`` (validated by the backend) for ``src``'s next message on
        ``tag``."""

    def pump(self) -> None:  # noqa: B027 (optional: most routes deliver by themselves)
        """Move what has arrived from :attr:`peers` into the mailbox without waiting (a receive
        from any rank calls it while it waits). The default does nothing: for a route whose
        own threads deliver every message."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the route holds (its threads); the backend calls it at its teardown."""


__all__ = ["Route"]
