"""Point-to-point messages through the engine's rings: the route of same-host peers.

Every ordered pair of ranks has a single-producer, single-consumer ring in the segment
(``_ring.pyx`` moves the bytes without the GIL). :class:`RingMesh` is a mesh backend's
:class:`~ferro_backend.mesh.route.Route` to the peers that share its segment (installed with
``TcpBackend.install_route``). A message travels one of three ways, in FIFO order with every
other message of its pair:

* **eager** (up to 16 KiB, less in a small ring): one entry, copied in by the sender and out by
  the receiver; the send returns as soon as the entry is written;
* **streamed** (larger ones, while the ranks do not outnumber the cores): the message flows
  through the ring in chunks (16 KiB up to a quarter ring) that the receiver copies out while
  the sender copies the next ones in, both without the GIL;
* **by descriptor** (from 256 KiB when the ranks outnumber the cores, or from 64 KiB with
  ``FERRO_SHM_CMA=always``; only where every rank may read every other's memory): the entry
  carries the address of the sender's buffer, the receiver copies the bytes straight out of the
  sender's memory (``process_vm_readv``: one copy, no running peer needed) and the send returns
  when the receiver has consumed the entry.

The receiving side (draining, the watch thread) is :mod:`.delivery`'s. Failures come from the
backend's mailbox (closed, dead and aborting peers) and the engine's failure flag, which wakes
every wait.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import settings
from ..checks import MAX_TAG, as_recv_view, as_send_view, check_tag, check_timeout, wait_limit
from ..errors import CollectiveTimeoutError, PeerClosedError
from ..mailbox import Mailbox
from ..mesh.route import Route
from . import _ring
from .delivery import DEGRADED_SLICE, Delivery, RingRecv
from .segment import Engine, oversubscribed

#: the largest eager message and streamed chunk: 16 KiB entries (smaller pipeline better, larger
#: ones pay less per entry)
EAGER_MAX = (16 << 10) - _ring.ENTRY_HEADER
#: with FERRO_SHM_CMA=always, messages from this size go by descriptor
CMA_THRESHOLD = 64 << 10
#: oversubscribed, messages from this size go by descriptor (benchmarks/README.md: 4 processes
#: on 2 cores, descriptors against streaming)
OVERSUBSCRIBED_CMA = 256 << 10
#: the speed of a cross-memory copy here, roughly: a sender spins (rather than sleeps) for the
#: time its receiver's copy should take
CMA_BYTES_PER_S = 5e9
#: a streamed send made while receives are posted waits for room this long at a time, taking
#: what the peers sent in between (in an exchange each side's watch thread would move it
#: after a whole WATCH_PERIOD: 1 MiB each way took 1.3 ms, 50 us one way) ...
EXCHANGE_SLICE = 50e-6
#: ... until nothing has moved for this long: then it waits as any send does (a wait that
#: rings the receiver's doorbell, for its watch thread), in slices of EXCHANGE_STALLED, still
#: taking what the peers sent between them: two ranks of an exchange whose sends both waited so
#: (one rank off its core for a millisecond, on a loaded host) would otherwise sit until a
#: watch thread moved one side's message
EXCHANGE_PATIENCE = 1e-3
EXCHANGE_STALLED = 5e-3


class RingMesh(Route):
    """This rank's ends of the rings of ``engine``; ``ranks[i]`` is the job rank of the
    segment's rank ``i`` (default: the same; a multi-node job maps one segment per node), and
    every rank this class takes or names is a job rank, as the mailbox's are."""

    def __init__(self, engine: Engine, box: Mailbox, timeout: Callable[[], float],
                 ranks: Sequence[int] | None = None) -> None:
        n, me = engine.nranks, engine.rank
        ranks = list(range(n)) if ranks is None else list(ranks)
        self.rank, self.box, self.timeout = ranks[me], box, timeout
        self.peers = frozenset(ranks[i] for i in range(n) if i != me)
        # a rank per core: both ends run at once, and streaming through the ring beats the
        # cross-memory copy at every size (no page pinning); oversubscribed, one system call
        # that needs no running peer is better. FERRO_SHM_CMA=always/never forces either.
        forced = settings.SHM_CMA.get() == "always"
        #: messages at least this large go by descriptor (None: streamed)
        self.cma_threshold = (None if not engine.cma_ok else CMA_THRESHOLD if forced
                              else OVERSUBSCRIBED_CMA if oversubscribed(n) else None)
        #: job rank -> the ring to it, and the lock its producers hold
        self.out = {ranks[i]: engine.ring(me, i) for i in range(n) if i != me}
        self.locks = {p: threading.Lock() for p in self.out}
        #: the largest message that travels as one entry, and the chunk of a streamed one
        self.eager_max = min(EAGER_MAX, engine.ring_bytes // 4 - _ring.ENTRY_HEADER)
        self.delivery = Delivery(engine, box, ranks)
        self.bytes_sent = 0

    @property
    def bytes_received(self) -> int:  # type: ignore[override]
        return self.delivery.received

    # ------------------------------------------------------------------ sending
    def send(self, data: Any, dst: int, tag: int) -> None:
        box = self.box
        if (type(data) is np.ndarray and type(tag) is int and 0 <= tag <= MAX_TAG
                and data.nbytes <= self.eager_max and data.flags.c_contiguous
                and data.dtype.kind not in "OMm"  # (what no buffer holds: as_send_view's error)
                and box.aborted is None and not box.closed
                and dst not in box.closed_peers):  # a small array, checked at a glance
            deadline = time.monotonic() + self.timeout()
            rc = self._send_eager(data, data.nbytes, dst, tag, deadline)
            if rc == _ring.READY:
                return
            if rc == _ring.TIME_UP:
                raise CollectiveTimeoutError(
                    f"send: rank {self.rank} -> {dst} (tag {tag}): {data.nbytes} bytes not "
                    f"taken by the peer within {self.timeout():g}s (its ring stayed full)")
        check_tag(tag)
        view = as_send_view(data)
        box.check("send", dst)
        self._send_view(view, dst, tag)

    def _send_eager(self, buf, nbytes: int, dst: int, tag: int, deadline: float) -> int | None:
        """``buf`` (``nbytes <= eager_max``) as one entry. READY; TIME_UP or FAILED (nothing
        written); None: another thread is sending to ``dst`` (the general path waits)."""
        lock = self.locks[dst]
        if not lock.acquire(False):
            return None
        try:
            rc = self.out[dst].put(_ring.EAGER, tag, nbytes, 0, buf, deadline)[0]
        finally:
            lock.release()
        if rc == _ring.READY:
            self.bytes_sent += nbytes
        return rc

    def _send_view(self, view: memoryview, dst: int, tag: int) -> None:
        nbytes = len(view)
        deadline = time.monotonic() + self.timeout()
        ring, lock = self.out[dst], self.locks[dst]
        if nbytes <= self.eager_max and self._send_eager(view, nbytes, dst, tag,
                                                        deadline) == _ring.READY:
            return  # else nothing was written: the general path below waits, or names why

        def late() -> str:
            return (f"send: rank {self.rank} -> {dst} (tag {tag}): {nbytes} bytes not taken "
                    f"by the peer within {self.timeout():g}s")

        if not lock.acquire(timeout=wait_limit(max(0.0, deadline - time.monotonic()))):
            raise CollectiveTimeoutError(late())
        try:
            if nbytes <= self.eager_max:
                self._put(ring, _ring.EAGER, tag, nbytes, 0, view, deadline, dst, late)
            elif self.cma_threshold is not None and nbytes >= self.cma_threshold:
                self._send_descriptor(ring, view, dst, tag, deadline, late)
            else:
                reached = 0
                # a pipeline of at least 16 chunks, each from 16 KiB up to a quarter ring
                step = min(ring.max_payload, max(self.eager_max, nbytes // 16 // 64 * 64))

                def stream(until: float, watch: bool) -> int:
                    nonlocal reached
                    stalled = None  # since when no chunk went in
                    while True:
                        now = time.monotonic()
                        if not self._receiving():
                            rc, reached = ring.put_stream(tag, view, reached, step, until, watch)
                            return rc
                        # receives are posted here: their senders may be waiting for room as
                        # this rank does (an exchange, a ring of ranks). Take what they sent,
                        # so that they go on, between short waits; where that moves nothing
                        # for a while, between longer ones
                        self.delivery.progress_all()
                        before = reached
                        wait = EXCHANGE_SLICE if stalled is None or \
                            now - stalled <= EXCHANGE_PATIENCE else EXCHANGE_STALLED
                        rc, reached = ring.put_stream(tag, view, reached, step,
                                                      min(until, now + wait), watch)
                        if rc != _ring.TIME_UP or time.monotonic() >= until:
                            return rc
                        stalled = None if reached > before else (stalled or now)

                self._await(stream, deadline, "send", dst, late)
        finally:
            lock.release()
        self.bytes_sent += nbytes

    def _receiving(self) -> bool:
        """Whether a receive is posted here, or a message streamed to this rank is part-taken
        (its sender may be waiting for this rank to take the rest)."""
        box = self.box
        return bool(box.posted) or bool(box.posted_any) or self.delivery.streaming_in()

    def _send_descriptor(self, ring: _ring.Ring, view: memoryview, dst: int, tag: int,
                         deadline: float, late: Callable[[], str]) -> None:
        """The message's address as one entry; return once the receiver has copied it."""
        nbytes = len(view)
        arr = np.frombuffer(view, dtype=np.uint8)  # keeps `view` alive; its address
        start, end = self._put(ring, _ring.CMA, tag, nbytes, arr.ctypes.data, None, deadline,
                               dst, late)
        # two ranks that send to each other, then receive (an exchange): the later one finds
        # the earlier one's message here and takes it now, instead of both waiting for their
        # watch threads (4 emulated nodes x 2 ranks on 2 cores, 1 MiB: 3-6 ms a round)
        self.delivery.try_progress(dst)
        busy = time.monotonic() + nbytes / CMA_BYTES_PER_S + 30e-6  # the peer's copy
        self._await(lambda until, w: ring.wait_consumed(end, until, w, busy), deadline, "send",
                    dst, late)
        status = ring.status_at(start)
        if status:
            raise PeerClosedError(f"send: rank {self.rank} -> {dst} (tag {tag}): the peer "
                                  f"could not read the message ({os.strerror(status)})", peer=dst)

    def _put(self, ring: _ring.Ring, kind: int, tag: int, total: int, aux: int, payload,
             deadline: float, dst: int, late: Callable[[], str]) -> tuple[int, int]:
        spot = [0, 0]

        def attempt(until: float, watch: bool) -> int:
            rc, spot[0], spot[1] = ring.put(kind, tag, total, aux, payload, until, watch)
            return rc

        self._await(attempt, deadline, "send", dst, late)
        return spot[0], spot[1]

    def _await(self, attempt: Callable[[float, bool], int], deadline: float, op: str,
               peer: int, late: Callable[[], str]) -> None:
        """Run ``attempt(until, watch_failed)`` until it returns READY; raise ``peer``'s
        failure, or CollectiveTimeoutError (message from ``late()``) at ``deadline``."""
        watch = True
        while True:
            now = time.monotonic()
            rc = attempt(deadline if watch else min(deadline, now + DEGRADED_SLICE), watch)
            if rc == _ring.READY:
                return
            failure = self.box.failure(op, peer)
            if failure is not None:
                raise failure
            if rc == _ring.FAILED:
                watch = False  # another peer's failure: this pair goes on, checked per slice
            elif time.monotonic() >= deadline:
                raise CollectiveTimeoutError(late())

    # ------------------------------------------------------------------ receiving
    def irecv(self, view: memoryview, src: int, tag: int) -> RingRecv:
        return RingRecv(self.delivery, self.box.post(src, tag, view, check=False), self.timeout)

    def recv(self, out: Any, src: int, tag: int, timeout: float | None) -> None:
        if self.box.closed:  # (a forked child's copy must not take the parent's messages)
            raise self.box.failure("recv", src)
        delivery = self.delivery
        if (type(out) is np.ndarray and type(tag) is int and 0 <= tag <= MAX_TAG
                and (timeout is None or type(timeout) is float and timeout >= 0)
                and out.flags.c_contiguous and out.flags.writeable
                and out.dtype.kind not in "OMm"):  # checked at a glance
            limit = self.timeout() if timeout is None else timeout
            deadline = time.monotonic() + limit
            done = delivery.recv_now(out, out.nbytes, src, tag, deadline)
            view = as_recv_view(out) if done is False else None
        else:
            check_tag(tag)
            view = as_recv_view(out)
            limit = self.timeout() if timeout is None else check_timeout(timeout,
                                                                         "recv: timeout")
            deadline = time.monotonic() + limit
            done = delivery.recv_now(view, len(view), src, tag, deadline)
        if done is True:
            return
        req = self.box.post(src, tag, view, check=False) if done is False else done
        RingRecv(delivery, req, self.timeout).wait_until(deadline, limit)

    def pump(self) -> None:
        if self.box.closed:  # (as recv)
            return
        for src in self.peers:
            self.delivery.try_progress(src)

    def close(self) -> None:
        """Stop the watch thread (the rings stay mapped while the engine lives)."""
        self.delivery.close()


__all__ = ["CMA_THRESHOLD", "EAGER_MAX", "RingMesh"]
