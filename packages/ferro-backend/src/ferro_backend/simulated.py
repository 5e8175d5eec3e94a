"""An in-process backend: every rank is an object of one group, ranks usually run as threads.

Thread-safe, FIFO per ``(src, dst, tag)``. A send copies its bytes once: straight into the
destination's posted receive buffer when there is one, else into a queue. Sends never block.
"""

from __future__ import annotations

from typing import Any

from .base import (
    DEFAULT_TIMEOUT,
    Backend,
    Request,
    as_recv_view,
    as_send_view,
    check_peer,
    check_tag,
    check_world_size,
)
from .errors import PeerAbortedError, PeerClosedError
from .mailbox import Mailbox


class _Group:
    def __init__(self, world_size: int, timeout: float) -> None:
        self.mailboxes = [Mailbox(r, timeout) for r in range(world_size)]
        self.closed: set[int] = set()
        self.aborted: tuple[int, str] | None = None


class SimulatedBackend(Backend):
    """One rank of an in-process group made by :meth:`create_group`."""

    def __init__(self, group: _Group, rank: int, timeout: float) -> None:
        self._group = group
        self._rank = rank
        self.timeout = timeout

    @classmethod
    def create_group(cls, world_size: int, *, timeout: float = DEFAULT_TIMEOUT
                     ) -> list[SimulatedBackend]:
        """Create ``world_size`` connected backends; index ``i`` is rank ``i``.

        Raises :class:`InvalidWorldSizeError` for ``world_size < 1``.
        """
        check_world_size(world_size)
        group = _Group(world_size, timeout)
        return [cls(group, r, timeout) for r in range(world_size)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._group.mailboxes)

    def _check_peer(self, op: str, peer: int, what: str) -> None:
        check_peer(op, peer, self._rank, self.world_size, what)

    def _check_alive(self, op: str, peer: int) -> None:
        group = self._group
        if group.aborted is not None:
            who, reason = group.aborted
            raise PeerAbortedError(f"rank {who} aborted the job: {reason}", peer=who,
                                   reason=reason)
        if self._rank in group.closed:
            raise PeerClosedError(f"{op}: rank {self._rank} is closed", peer=self._rank)
        if peer in group.closed:
            raise PeerClosedError(f"{op}: rank {self._rank} -> {peer}: peer rank {peer} is closed",
                                  peer=peer)

    def send(self, data: Any, dst: int, *, tag: int = 0) -> None:
        self._check_peer("send", dst, "dst")
        check_tag(tag)
        view = as_send_view(data)
        self._check_alive("send", dst)
        box = self._group.mailboxes[dst]
        req = box.claim(self._rank, tag)
        if req is not None:
            box.fill(req, view)
        else:
            box.deliver(self._rank, tag, bytes(view))

    def irecv(self, out: Any, src: int, *, tag: int = 0) -> Request:
        self._check_peer("recv", src, "src")
        check_tag(tag)
        view = as_recv_view(out)
        return self._group.mailboxes[self._rank].post(src, tag, view)

    def recv(self, out: Any, src: int, *, tag: int = 0, timeout: float | None = None) -> None:
        self.irecv(out, src, tag=tag).wait(timeout)

    def abort(self, reason: str) -> None:
        group = self._group
        if group.aborted is None:
            group.aborted = (self._rank, reason)
        for box in group.mailboxes:
            box.abort(self._rank, reason)
        self.close()

    def close(self) -> None:
        group = self._group
        if self._rank in group.closed:
            return
        group.closed.add(self._rank)
        for r, box in enumerate(group.mailboxes):
            if r == self._rank:
                box.close()
            else:
                box.peer_closed(self._rank, "closed")
