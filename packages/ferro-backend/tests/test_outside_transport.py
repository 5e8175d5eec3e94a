"""An outside transport written from the README: what the base class gives it (its own closed or
aborted state, through ``super().close()`` and the default ``abort``), and the conformance kit's
promises that catch the transports that break what the collectives rely on (64-bit tags, abort
wins over data, sends to a gone peer raise, every call after close or abort raises, abort
implemented)."""

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
    SimulatedBackend,
    SizeMismatchError,
)
from ferro_backend.testing import check_backend, run_threads

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


def test_an_outside_transport_that_follows_the_readme_passes():
    check_backend(_Queue.create_group, world_sizes=(1, 2, 3))


def test_simulated_passes_the_new_promises_at_one_two_and_three_ranks():
    check_backend(SimulatedBackend.create_group, world_sizes=(1, 2, 3))


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


# -- deficient transports the kit now names ---------------------------------------------------
class _Tag32(SimulatedBackend):
    """Keeps only the low 32 bits of a tag: a subgroup's messages mix with the parent's."""

    def send(self, data, dst, *, tag=0):
        super().send(data, dst, tag=tag & 0xFFFFFFFF)

    def irecv(self, out, src, *, tag=0):
        return super().irecv(out, src, tag=tag & 0xFFFFFFFF)


class _NoSuperClose(_Queue):
    """close() never reaches Backend.close: nothing records it (its own send/recv check the
    hub only for peers)."""

    def close(self):
        with self._hub.cond:
            self._hub.closed.add(self._rank)
            self._hub.cond.notify_all()




class _DataFirst(_Queue):
    """Delivers what an aborted rank sent before its abort (data wins over abort)."""

    def _take(self, key, src):
        queue = self._hub.queues[key]
        if queue:
            return queue.popleft()
        return super()._take(key, src)


class _SendsIntoTheVoid(_Queue):
    """A send to an aborted or closed peer is dropped without an error."""

    def _gone(self, op, peer):
        if op != "send":
            super()._gone(op, peer)


@pytest.mark.parametrize("cls, sizes, promise", [
    (_Tag32, (2,), "tags are 64-bit.*mixed"),
    (_NoSuperClose, (1,), "after close\\(\\).*peer_failure.*super\\(\\).close"),
    (_InheritsAbort, (2,), "abort reaches the peers.*PeerClosedError, not PeerAbortedError"),
    (_DataFirst, (2,), "abort wins over data.*delivered after the abort was known"),
    (_SendsIntoTheVoid, (2,), "closed peer.*a send to a peer that closed"),
])
def test_the_kit_names_the_broken_promise(cls, sizes, promise):
    with pytest.raises(AssertionError, match=promise):
        check_backend(cls.create_group, world_sizes=sizes)


def test_tag32_mixes_a_subgroup_with_its_parent():
    """What the 64-bit tag promise protects: on the 32-bit transport, the parent's receive on
    tag 5 takes the subgroup's message."""
    from ferro_backend import SubBackend

    def fn(b):
        s = SubBackend(b, [0, 1])
        if b.rank == 0:
            s.send(b"S", 1, tag=5)
            b.send(b"P", 1, tag=5)
            return None
        got = bytearray(1)
        b.recv(got, 0, tag=5, timeout=10)
        return bytes(got)

    assert run_threads(fn, SimulatedBackend.create_group(2), timeout=30)[1] == b"P"
    assert run_threads(fn, _Tag32.create_group(2), timeout=30)[1] == b"S"
