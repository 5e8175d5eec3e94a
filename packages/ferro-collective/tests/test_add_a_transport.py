"""Adding a transport touches only its own module: ``QueueBackend`` (ranks as threads of one
process, a message a copy in its receiver's queue) implements what a transport must (``rank``,
``world_size``, ``send``, ``recv``, ``close`` calling ``super().close()``, and ``abort``),
passes ferro-backend's conformance kit (``ferro_backend.testing.check_backend``) and then runs
every collective of ferro-collective against numpy's reference. ``docs/guide/architecture.md``
("how to add a transport") walks through this module."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

import numpy as np
import pytest

import ferro_collective as fc
from ferro_backend import (
    Backend,
    CollectiveTimeoutError,
    PeerAbortedError,
    PeerClosedError,
    SizeMismatchError,
)
from ferro_backend.testing import check_backend, run_threads

pytestmark = pytest.mark.timeout(180)


class _Hub:
    """What the ranks of one group share: a queue per (receiver, sender, tag), who has closed
    or aborted, one condition to wait on."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int, int], deque[bytes]] = defaultdict(deque)
        self.closed: set[int] = set()
        self.aborted: dict[int, str] = {}
        self.cond = threading.Condition()


class QueueBackend(Backend):
    """A transport for ranks that are threads of one process."""

    def __init__(self, hub: _Hub, rank: int, world_size: int) -> None:
        self._hub, self._rank, self._n = hub, rank, world_size

    @classmethod
    def create_group(cls, n: int) -> list[QueueBackend]:
        hub = _Hub()
        return [cls(hub, r, n) for r in range(n)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._n

    def _check_up(self, op: str) -> None:
        """Raise if this backend is closed or aborted (Backend.close/abort recorded it)."""
        failure = self.peer_failure(op, self._rank)
        if failure is not None:
            raise failure

    def send(self, data, dst: int, *, tag: int = 0) -> None:
        self._check_up("send")
        payload = bytes(self._send_view(data, dst, tag))  # checks dst and tag; a copy
        hub = self._hub
        with hub.cond:
            if dst in hub.aborted:
                raise PeerAbortedError(f"send: rank {dst} aborted: {hub.aborted[dst]}")
            if dst in hub.closed:
                raise PeerClosedError(f"send: rank {dst} has closed")
            hub.queues[dst, self._rank, tag].append(payload)
            hub.cond.notify_all()

    def recv(self, out, src: int, *, tag: int = 0, timeout: float | None = None) -> None:
        self._check_up("recv")
        view = self._recv_view(out, src, tag).cast("B")
        deadline = time.monotonic() + self.resolve_timeout(timeout, "recv: timeout")
        hub, key = self._hub, (self._rank, src, tag)
        with hub.cond:
            while True:
                if src in hub.aborted:  # abort wins over the messages src sent before it
                    raise PeerAbortedError(f"recv: rank {src} aborted: {hub.aborted[src]}")
                self._check_up("recv")  # closed while this receive waited
                if hub.queues[key]:
                    break
                if src in hub.closed:
                    raise PeerClosedError(f"recv: rank {src} has closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeoutError(
                        f"recv: rank {self._rank} timed out waiting for rank {src} (tag {tag})")
                hub.cond.wait(left)
            payload = hub.queues[key].popleft()
        if len(payload) != view.nbytes:
            raise SizeMismatchError(f"recv: rank {src} sent {len(payload)} bytes on tag {tag}, "
                                    f"the buffer holds {view.nbytes}")
        view[:] = payload

    def abort(self, reason: str) -> None:
        with self._hub.cond:
            self._hub.aborted.setdefault(self._rank, reason)
            self._hub.cond.notify_all()
        super().abort(reason)  # records it (peer_failure) and closes

    def close(self) -> None:
        super().close()  # records it: peer_failure reports this backend closed
        with self._hub.cond:
            self._hub.closed.add(self._rank)
            self._hub.cond.notify_all()


def test_it_keeps_the_backend_contract():
    check_backend(QueueBackend.create_group, world_sizes=(2, 3))


def collectives(b) -> list[str]:
    """Every collective of ferro-collective on ``b``, against numpy; the failures."""
    n, r = b.world_size, b.rank
    bad = []
    xs = [np.arange(12, dtype=np.float64).reshape(3, 4) * (k + 1) for k in range(n)]
    checks = {
        "allreduce": lambda: np.array_equal(fc.allreduce(xs[r], b), sum(xs)),
        "allreduce max": lambda: np.array_equal(fc.allreduce(xs[r], b, fc.ReduceOp.MAX),
                                                xs[-1]),
        "broadcast": lambda: np.array_equal(fc.broadcast(xs[r], b, root=n - 1), xs[-1]),
        "all_gather": lambda: np.array_equal(fc.all_gather(xs[r], b), np.concatenate(xs)),
        "reduce_scatter": lambda: np.array_equal(
            fc.reduce_scatter(np.arange(4.0 * n) + r, b),
            (n * np.arange(4.0 * n) + n * (n - 1) / 2)[4 * r:4 * r + 4]),
        "reduce": lambda: _rooted(fc.reduce(xs[r], b, root=0), r == 0, sum(xs)),
        "gather": lambda: _rooted(fc.gather(xs[r], b, root=1), r == 1, np.concatenate(xs)),
        "scatter": lambda: np.array_equal(
            fc.scatter(np.concatenate(xs) if r == 0 else None, b, root=0), xs[r]),
        "all_gather_v": lambda: [a.shape[0] for a in fc.all_gather_v(np.ones((r, 2)), b)]
        == list(range(n)),
        "all_to_all": lambda: [int(a[0]) for a in fc.all_to_all(
            [np.full(1, 10 * r + d) for d in range(n)], b)] == [10 * s + r for s in range(n)],
        "all_gather_object": lambda: fc.all_gather_object({"rank": r}, b)
        == [{"rank": k} for k in range(n)],
        "barrier": lambda: fc.barrier(b) is None,
        "allreduce_async": lambda: np.array_equal(
            fc.allreduce_async(xs[r], b).wait(timeout=30), sum(xs)),
    }
    for name, check in checks.items():
        if not check():
            bad.append(name)
    return bad


def _rooted(result, root: bool, want) -> bool:
    return np.array_equal(result, want) if root else result is None


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_collective_runs_on_it(n):
    group = QueueBackend.create_group(n)
    try:
        assert run_threads(collectives, group, timeout=120) == [[]] * n
    finally:
        for b in group:
            b.close()
