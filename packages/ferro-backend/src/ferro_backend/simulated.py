"""An in-process backend: every rank is an object of one group, ranks usually run as threads.

Thread-safe, FIFO per ``(src, dst, tag)``. A send copies its bytes once: straight into the
destination's posted receive buffer when there is one, else into a queue. Sends never block.
"""

from __future__ import annotations

from typing import Any

from .base import DEFAULT_TIMEOUT, Backend, FixedRanks, Request, check_timeout, check_world_size
from .mailbox import Mailbox


class SimulatedBackend(FixedRanks, Backend):
    """One rank of an in-process group made by :meth:`create_group`."""

    def __init__(self, mailboxes: list[Mailbox], rank: int, timeout: float) -> None:
        self._boxes = mailboxes
        self._rank = rank
        self._world = len(mailboxes)
        self.timeout = timeout
        self._box = mailboxes[rank]

    @classmethod
    def create_group(cls, world_size: int, *, timeout: float = DEFAULT_TIMEOUT
                     ) -> list[SimulatedBackend]:
        """Create ``world_size`` connected backends; index ``i`` is rank ``i``.

        ``timeout`` is every rank's :attr:`Backend.timeout`: the default deadline of its
        receives, barriers and collectives.

        Raises :class:`InvalidWorldSizeError` for ``world_size < 1``, ValueError for a
        timeout that is negative, NaN or not a number.
        """
        check_world_size(world_size)
        timeout = check_timeout(timeout, "SimulatedBackend.create_group: timeout")
        ranks: list[SimulatedBackend] = []
        boxes = [Mailbox(r, lambda r=r: ranks[r].timeout) for r in range(world_size)]
        ranks.extend(cls(boxes, r, timeout) for r in range(world_size))
        return ranks

    def send(self, data: Any, dst: int, *, tag: int = 0) -> None:
        view = self._send_view(data, dst, tag)
        self._box.check("send", dst)
        box = self._boxes[dst]
        req = box.claim(self._rank, tag)
        if req is not None:
            box.fill(req, view)
        else:
            box.deliver(self._rank, tag, bytes(view))
        self.bytes_sent += len(view)

    def irecv(self, out: Any, src: int, *, tag: int = 0) -> Request:
        return self._box.post(src, tag, self._recv_view(out, src, tag))

    def recv(self, out: Any, src: int, *, tag: int = 0, timeout: float | None = None) -> None:
        self.irecv(out, src, tag=tag).wait(self.resolve_timeout(timeout, "recv: timeout"))

    def abort(self, reason: str) -> None:
        for box in self._boxes:
            box.abort(self._rank, reason)
        self.close()

    def close(self) -> None:
        if self._box.closed:
            return
        for r, box in enumerate(self._boxes):
            if r == self._rank:
                box.close()
            else:
                box.peer_closed(self._rank, "closed")
