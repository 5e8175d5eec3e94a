"""An outside transport written from the README: what the base class gives it (its own closed or
aborted state, through ``super().close()`` and the default ``abort``)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

import pytest

from ferro_backend import (
    Backend,
    CollectiveTimeoutError,
    PeerAbortedError,
    PeerClosedError,
    SizeMismatchError,
)

pytestmark = pytest.mark.timeout(180)


class _Hub:
    def __init__(self) -> None:
        self.queues: dict[tuple[int, int, int], deque[bytes]] = defaultdict(deque)
        self.closed: set[int] = set()
        self.aborted: dict[int, str] = {}
        self.cond = threading.Condition()


class _Queue(Backend):
    """A transport over queues between threads, as the README's outside-transport sentence and
    the Backend docstrings ask."""

    def __init__(self, hub: _Hub, rank: int, n: int) -> None:
        self._hub, self._rank, self._n = hub, rank, n

    @classmethod
    def create_group(cls, n: int) -> list[_Queue]:
        hub = _Hub()
        return [cls(hub, r, n) for r in range(n)]

    rank = property(lambda self: self._rank)
    world_size = property(lambda self: self._n)

    def _check_up(self, op: str) -> None:
        failure = self.peer_failure(op, self._rank)
        if failure is not None:
            raise failure

    def _gone(self, op: str, peer: int) -> None:
        hub = self._hub
        if peer in hub.aborted:
            raise PeerAbortedError(f"{op}: rank {peer} aborted: {hub.aborted[peer]}", peer=peer)
        if peer in hub.closed:
            raise PeerClosedError(f"{op}: rank {peer} has closed", peer=peer)

    def send(self, data, dst, *, tag=0):
        self._check_up("send")
        payload = bytes(self._send_view(data, dst, tag))
        with self._hub.cond:
            self._gone("send", dst)
            self._hub.queues[dst, self._rank, tag].append(payload)
            self._hub.cond.notify_all()

    def _take(self, key, src):
        """(cond held) The next queued message, or None; abort wins over data."""
        if src in self._hub.aborted:
            self._gone("recv", src)
        queue = self._hub.queues[key]
        return queue.popleft() if queue else None

    def recv(self, out, src, *, tag=0, timeout=None):
        self._check_up("recv")
        view = self._recv_view(out, src, tag).cast("B")
        deadline = time.monotonic() + self.resolve_timeout(timeout, "recv: timeout")
        key = (self._rank, src, tag)
        with self._hub.cond:
            while True:
                self._check_up("recv")
                payload = self._take(key, src)
                if payload is not None:
                    break
                self._gone("recv", src)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeoutError(f"recv: rank {self._rank} timed out")
                self._hub.cond.wait(left)
        if len(payload) != view.nbytes:
            raise SizeMismatchError(f"recv: {len(payload)} bytes into {view.nbytes}")
        view[:] = payload

    def abort(self, reason):
        with self._hub.cond:
            self._hub.aborted.setdefault(self._rank, reason)
            self._hub.cond.notify_all()
        super().abort(reason)

    def close(self):
        super().close()
        with self._hub.cond:
            self._hub.closed.add(self._rank)
            self._hub.cond.notify_all()


class _InheritsAbort(_Queue):
    """Implements no abort: the inherited one tells the peers nothing of the reason."""

    abort = Backend.abort


# -- what the base class does for it --------------------------------------------------------
def test_super_close_makes_every_later_call_raise_even_on_one_rank():
    """0.4's Backend.close recorded nothing and the default peer_failure said None: a closed
    one-rank outside backend still ran barriers and collectives (the layers ask peer_failure)."""
    (b,) = _Queue.create_group(1)
    assert b.peer_failure("x", 0) is None
    b.close()
    assert isinstance(b.peer_failure("allreduce", 0), PeerClosedError)
    with pytest.raises(PeerClosedError, match="rank 0's backend is closed"):
        b.barrier(timeout=5)
    b.close()  # idempotent


def test_the_default_abort_records_and_closes():
    """The inherited abort was a no-op: the aborting rank's peers waited out their deadline.
    Now it records the abort (this rank's calls raise PeerAbortedError naming the reason) and
    closes the backend, so the peers' receives from it fail at once (PeerClosedError: the
    default cannot tell them the reason)."""

    a, b = _InheritsAbort.create_group(2)
    for x in (a, b):
        x.timeout = 30.0
    b.abort("rank 1 gave up")
    failure = b.peer_failure("allreduce", 1)
    assert isinstance(failure, PeerAbortedError) and failure.reason == "rank 1 gave up"
    with pytest.raises(PeerClosedError):
        b.send(b"x", 0)
    t0 = time.monotonic()
    with pytest.raises(PeerClosedError):
        a.recv(bytearray(1), 1)
    assert time.monotonic() - t0 < 5
