"""ShmBackend's point-to-point messages through the engine segment's rings.

Every ordered pair of ranks has a single-producer, single-consumer ring in the job's segment
(``engine.py`` lays them out, ``_ring.pyx`` moves the bytes without the GIL). A message travels
one of three ways, in FIFO order with every other message of its pair:

* **eager** (up to 16 KiB, less in a small ring): one entry, copied in by the sender and out by the
  receiver; the send returns as soon as the entry is written;
* **streamed** (larger ones, while the ranks do not outnumber the cores): the message flows
  through the ring in chunks (16 KiB up to a quarter ring) that the receiver copies out while
  the sender copies the next ones in, both without the GIL;
* **by descriptor** (from 256 KiB when the ranks outnumber the cores, or from ``cma_threshold``
  with ``FERRO_SHM_CMA=always``; only where every rank may read every other's memory): the entry
  carries the address of the sender's buffer, the receiver copies the bytes straight out of the
  sender's memory (``process_vm_readv``, one copy, no running peer needed) and the send returns
  when the receiver has consumed the entry.

Nobody polls on the receiver's behalf: a thread in ``recv`` drains the ring from its source
itself (spinning briefly, then sleeping on a futex the sender wakes), delivering entries for
other receives into the mailbox as it goes. So that a sender never waits on a receiver that has
not posted yet (the Backend contract), a sender about to sleep (its ring is full, or its
descriptor unread) rings the receiver's doorbell, and the receiver's *watch* thread, asleep on
it without the GIL, moves entries that then sit unconsumed for a whole period (1 ms) into the
mailbox's queue of unexpected messages. Small messages a receiver has not asked for yet stay in
the ring (no extra copy) and an idle rank's watch thread never wakes.

Failures come from the transport as before (the mailbox's record of closed, dead and aborting
peers, and the segment's failure flag that wakes every wait): a receive first drains what its
peer sent before it went away, then raises.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from . import settings
from ._platform import _ring, _shm
from .base import Request, as_recv_view, check_timeout, size_mismatch
from .engine import SharedSegment
from .errors import CollectiveTimeoutError, PeerClosedError
from .mailbox import Mailbox, PostedRecv

READY, TIME_UP = (_ring.READY, _ring.TIME_UP) if _ring is not None else (0, 1)
#: how long entries must sit unconsumed after a doorbell before the watch thread moves them
WATCH_PERIOD = 1e-3
#: seconds of one wait while another peer's failure is known (the failure flag is up for good)
DEGRADED_SLICE = 0.05
#: the largest eager message and streamed chunk: 16 KiB entries (smaller pipeline better, larger
#: ones pay less per entry)
EAGER_MAX = (16 << 10) - _ring.ENTRY_HEADER if _ring is not None else 0
#: a drain waits this long for the next chunk of a message being streamed before it moves on
STREAM_IDLE = 0.02
#: with FERRO_SHM_CMA=always, messages from this size go by descriptor
CMA_THRESHOLD = 64 << 10
#: oversubscribed, messages from this size go by descriptor (4 processes on 2 cores, pairs in
#: ping-pong: streaming 1.0-1.9 GB/s against 0.8-0.9 at 64 KiB, descriptors 3.8-4.5 against
#: 2.2-2.4 at 1 MiB)
OVERSUBSCRIBED_CMA = 256 << 10
#: the speed of a cross-memory copy here, roughly: a sender spins (rather than sleeps) for the
#: time its receiver's copy should take
CMA_BYTES_PER_S = 5e9


class RingMesh:
    """This rank's ends of the point-to-point rings of ``seg``: ``send``/``recv_now``/
    ``progress``. ``ranks[i]`` is the job rank of the segment's rank ``i`` (default: the same;
    a multi-node job maps one segment per node), and every rank this class takes or names is a
    job rank, as the mailbox's are."""

    def __init__(self, seg: SharedSegment, box: Mailbox, timeout: Callable[[], float],
                 cma_threshold: int = CMA_THRESHOLD,
                 ranks: Sequence[int] | None = None) -> None:
        n, me = seg.nranks, seg.rank
        ranks = list(range(n)) if ranks is None else list(ranks)
        self.rank, self.box, self.timeout = ranks[me], box, timeout
        self.pids = {ranks[i]: pid for i, pid in enumerate(seg.pids)}
        cores = os.cpu_count() or 1
        # a rank per core: both ends run at once, and streaming through the ring beats the
        # cross-memory copy at every size (no page pinning); oversubscribed, one system call
        # that needs no running peer is better. FERRO_SHM_CMA=always/0 forces either.
        forced = settings.SHM_CMA.get() == "always"
        #: messages at least this large go by descriptor (None: streamed)
        self.cma_threshold = (None if not seg.cma_ok else cma_threshold if forced
                              else OVERSUBSCRIBED_CMA if n > cores else None)
        spin = 4000 if n <= cores else 0
        # oversubscribed: yield the core a bounded number of times before sleeping (a round
        # trip is two wake-ups: 4 procs on 2 cores, 4 KiB ping-pong 0.10 GB/s with 100
        # yields, 0.26 with 1000, 0.18 with 10000)
        yields = 0 if n <= cores else settings.SHM_RING_YIELDS.get()
        # a view of the mapping: while it lives, the segment's close cannot unmap the rings
        self._keep = np.frombuffer(seg._mem, dtype=np.uint8)

        def ring(src: int, dst: int) -> _ring.Ring:
            ctrl, data, cap = seg.ring(src, dst)
            return _ring.Ring(ctrl, data, cap, seg.failed_address, seg.bell(dst), spin, yields)

        local = [i for i in range(n) if i != me]
        peers = [ranks[i] for i in local]
        #: job rank -> the ring to it / from it
        self.out = {ranks[i]: ring(me, i) for i in local}
        self.inc = {ranks[i]: ring(i, me) for i in local}
        #: the largest message that travels as one entry, and the chunk of a streamed one
        self.eager_max = min(EAGER_MAX, seg.ring(me, me)[2] // 4 - _ring.ENTRY_HEADER)
        self.out_locks = {p: threading.Lock() for p in peers}
        self.in_locks = {p: threading.Lock() for p in peers}
        #: src -> [request or None, buffer or None]: a chunked message being received
        self._partial: dict[int, list] = {}
        self.sent = self.received = 0
        self._stop = np.zeros(1, dtype=np.uint32)
        self._watch = _ring.Watch([seg.ring(i, me)[0] for i in local], seg.bell(me), self._stop)
        self._peers = peers
        self._watcher = threading.Thread(target=self._watch_loop, daemon=True,
                                         name=f"ferro-shm-watch-{self.rank}")
        self._watcher.start()

    # ------------------------------------------------------------------ waiting
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

    # ------------------------------------------------------------------ sending
    def send_eager(self, buf, nbytes: int, dst: int, tag: int, deadline: float) -> int | None:
        """The common send in one call: ``buf`` (``nbytes <= eager_max``, validated by the
        caller) as one entry. READY; TIME_UP or FAILED (nothing written); None: another thread
        is sending to ``dst`` (use :meth:`send`)."""
        lock = self.out_locks[dst]
        if not lock.acquire(False):
            return None
        try:
            rc = self.out[dst].put(_ring.EAGER, tag, nbytes, 0, buf, deadline)[0]
        finally:
            lock.release()
        if rc == _ring.READY:
            self.sent += nbytes
        return rc

    def send(self, view: memoryview, dst: int, tag: int) -> None:
        nbytes = len(view)
        deadline = time.monotonic() + self.timeout()
        ring, lock = self.out[dst], self.out_locks[dst]
        if nbytes <= self.eager_max:
            rc = self.send_eager(view, nbytes, dst, tag, deadline)
            if rc == _ring.READY:
                return
            # nothing was written: the general path below waits, or names the failure

        def late() -> str:
            return (f"send: rank {self.rank} -> {dst} (tag {tag}): {nbytes} bytes not taken "
                    f"by the peer within {self.timeout():g}s")

        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise CollectiveTimeoutError(late())
        try:
            if nbytes <= self.eager_max:
                self._put(ring, _ring.EAGER, tag, nbytes, 0, view, deadline, dst, late)
            elif self.cma_threshold is not None and nbytes >= self.cma_threshold:
                arr = np.frombuffer(view, dtype=np.uint8)  # keeps `view` alive; its address
                start, end = self._put(ring, _ring.CMA, tag, nbytes, arr.ctypes.data, None,
                                       deadline, dst, late)
                busy = time.monotonic() + nbytes / CMA_BYTES_PER_S + 30e-6  # the peer's copy
                self._await(lambda until, w: ring.wait_consumed(end, until, w, busy), deadline,
                            "send", dst, late)
                status = ring.status_at(start)
                if status:
                    raise PeerClosedError(f"send: rank {self.rank} -> {dst} (tag {tag}): the "
                                          f"peer could not read the message ({os.strerror(status)})",
                                          peer=dst)
            else:
                reached = 0
                # a pipeline of at least 16 chunks, each from 16 KiB up to a quarter ring
                step = min(ring.max_payload, max(self.eager_max, nbytes // 16 // 64 * 64))

                def stream(until: float, watch: bool) -> int:
                    nonlocal reached
                    rc, reached = ring.put_stream(tag, view, reached, step, until, watch)
                    return rc

                self._await(stream, deadline, "send", dst, late)
        finally:
            lock.release()
        self.sent += nbytes

    def _put(self, ring: _ring.Ring, kind: int, tag: int, total: int, aux: int, payload,
             deadline: float, dst: int, late: Callable[[], str]) -> tuple[int, int]:
        spot = [0, 0]

        def attempt(until: float, watch: bool) -> int:
            rc, spot[0], spot[1] = ring.put(kind, tag, total, aux, payload, until, watch)
            return rc

        self._await(attempt, deadline, "send", dst, late)
        return spot[0], spot[1]

    # ------------------------------------------------------------------ receiving
    def recv_now(self, view, nbytes: int, src: int, tag: int,
                 deadline: float) -> bool | PostedRecv:
        """The common receive in one go: when no other thread drains the ring from ``src`` and
        nothing for ``(src, tag)`` is queued or posted, wait for the next entry and, if it is
        this receive's message, copy it straight into ``view`` (no posted request, no mailbox):
        True. False: not that case (nothing consumed; post and :meth:`progress` instead). A
        request: a chunked message partly received (:meth:`progress` completes it)."""
        lock = self.in_locks[src]
        if not lock.acquire(False):
            return False
        try:
            box, key = self.box, (src, tag)
            if box.unexpected.get(key) or box.posted.get(key):
                return False
            ring = self.inc[src]
            while True:
                entry = ring.peek()
                if entry is None:
                    if ring.wait_data(deadline) != _ring.READY:
                        return False  # late or failing: the general path says which
                    continue
                kind, length, got_tag, total, aux = entry
                if got_tag != tag or total != nbytes:
                    return False
                if kind == _ring.EAGER:
                    ring.take(view)
                elif kind == _ring.CMA:
                    self._read_into(ring, src, tag, view, aux)
                elif kind == _ring.CHUNK and aux == 0:
                    _rc, reached = ring.take_stream(view, tag, 0, deadline)
                    if reached < total:  # the rest comes through the general path
                        req = PostedRecv(box, src, tag, as_recv_view(view))
                        self._partial[src] = [req, req.view]
                        return req
                else:
                    return False
                self.received += total
                return True
        finally:
            lock.release()

    def progress(self, req: PostedRecv, src: int, deadline: float) -> bool:
        """Drive the ring from ``src`` until ``req`` is complete (True) or ``deadline`` passes
        (False). Raises ``src``'s failure (after draining what it sent before it)."""
        ring, lock, box = self.inc[src], self.in_locks[src], self.box
        watch = True
        while not req._done:
            if not lock.acquire(False):  # another thread drains this ring: it delivers to us
                with box.cond:
                    if not req._done:
                        box.cond.wait(min(2e-3, max(0.0, deadline - time.monotonic())))
                if not req._done and time.monotonic() >= deadline:
                    return False
                continue
            try:
                while True:
                    self._drain(src)
                    if req._done:
                        return True
                    failure = box.failure("recv", src)
                    if failure is not None:
                        self._drain(src)  # what it sent before it went away is still there
                        if req._done:
                            return True
                        self.withdraw(req)
                        raise failure
                    now = time.monotonic()
                    if now >= deadline:
                        return False
                    until = deadline if watch else min(deadline, now + DEGRADED_SLICE)
                    if ring.wait_data(until, watch) == _ring.FAILED:
                        watch = False
            finally:
                lock.release()
                with box.cond:  # a receive waiting behind us may drain now
                    box.cond.notify_all()
        return True

    def try_progress(self, src: int) -> None:
        """Drain the ring from ``src`` if no other thread is at it (never waits)."""
        lock = self.in_locks[src]
        if self.inc[src].pending() and lock.acquire(False):
            try:
                self._drain(src)
            finally:
                lock.release()

    def withdraw(self, req: PostedRecv) -> bool:
        """Take a pending receive back from the mailbox; False if a drain already claimed it
        (it completes shortly)."""
        box = self.box
        with box.cond:
            queue = box.posted.get((req.src, req.tag))
            if queue is not None and req in queue:
                queue.remove(req)
                return True
        return False

    def _drain(self, src: int) -> None:
        """Move every entry of the ring from ``src`` into its receive (or the mailbox's queue
        of unexpected messages); the caller holds the ring's lock."""
        ring, box = self.inc[src], self.box
        while True:
            entry = ring.peek()
            if entry is None:
                return
            kind, length, tag, total, aux = entry
            if kind == _ring.EAGER:
                req = box.claim(src, tag)
                if req is None:
                    buf = bytearray(length)
                    ring.take(buf)
                    box.deliver(src, tag, buf)
                elif len(req.view) != length:
                    ring.skip()
                    req.fail(size_mismatch("recv", src, self.rank, tag, len(req.view), length))
                else:
                    ring.take(req.view)
                    req.complete()
                self.received += length
            elif kind == _ring.CHUNK:
                self._chunk(ring, src, length, tag, total, aux)
            elif kind == _ring.CMA:
                self._read_remote(ring, src, tag, total, aux)
            else:
                raise RuntimeError(f"ring {src} -> {self.rank}: unknown entry kind {kind} "
                                   "(the segment is corrupt)")

    def _chunk(self, ring: _ring.Ring, src: int, length: int, tag: int, total: int,
               offset: int) -> None:
        box = self.box
        part = self._partial.get(src)
        if part is None:
            req = box.claim(src, tag)
            if req is None:
                part = [None, bytearray(total)]
            elif len(req.view) != total:
                part = [req, None]  # a size mismatch: the chunks are skipped
            else:
                part = [req, req.view]
            self._partial[src] = part
        req, target = part
        if target is None:
            ring.skip()
            offset += length
        else:  # the sender streams the rest right behind: copy while it comes
            _rc, offset = ring.take_stream(target, tag, offset, time.monotonic() + STREAM_IDLE)
        if offset < total:
            return
        self.received += total
        del self._partial[src]
        if req is None:
            box.deliver(src, tag, target)
        elif target is None:
            req.fail(size_mismatch("recv", src, self.rank, tag, len(req.view), total))
        else:
            req.complete()

    def _read_remote(self, ring: _ring.Ring, src: int, tag: int, total: int,
                     address: int) -> None:
        box = self.box
        req = box.claim(src, tag)
        if req is not None and len(req.view) != total:
            ring.skip(0)
            req.fail(size_mismatch("recv", src, self.rank, tag, len(req.view), total))
            return
        buf = np.empty(total, dtype=np.uint8) if req is None else req.view
        try:
            self._read_into(ring, src, tag, buf, address)
        except PeerClosedError as error:
            if req is None:
                req = box.claim(src, tag)
            if req is not None:
                req.fail(error)
            return
        self.received += total
        if req is None:
            box.deliver(src, tag, buf)
        else:
            req.complete()

    def _read_into(self, ring: _ring.Ring, src: int, tag: int, buf, address: int) -> None:
        """Copy a descriptor's message out of the sender's memory into ``buf`` and consume
        the entry (its status tells the sender how it went)."""
        if not isinstance(buf, memoryview):  # an array of any dtype: its bytes
            buf = as_recv_view(buf)
        try:
            _shm.cma_read(self.pids[src], address, buf)
        except OSError as exc:
            ring.skip(exc.errno or 5)  # the sender (if alive) learns why
            raise PeerClosedError(f"recv: rank {self.rank} <- {src} (tag {tag}): cannot read "
                                  f"the sender's memory ({exc})", peer=src) from exc
        ring.skip(0)

    # ------------------------------------------------------------------ the watch thread
    def _watch_loop(self) -> None:
        while True:
            stale = self._watch.wait_stale(WATCH_PERIOD)
            if stale is None:
                return
            for i in stale:
                try:
                    self.try_progress(self._peers[i])
                except Exception:  # a corrupt ring: the receive that meets it raises
                    pass

    def close(self) -> None:
        """Stop the watch thread (the rings stay mapped while this object lives)."""
        self._watch.wake()
        if self._watcher is not threading.current_thread():
            self._watcher.join(2.0)


class RingRecv(Request):
    """A receive posted on a ring: waiting (or polling) drains the ring from its source."""

    __slots__ = ("_mesh", "_req")

    def __init__(self, mesh: RingMesh, req: PostedRecv) -> None:
        self._mesh = mesh
        self._req = req

    def is_completed(self) -> bool:
        if not self._req._done:
            self._mesh.try_progress(self._req.src)
        return self._req._done

    def poll(self, timeout: float = 0.0) -> bool:
        deadline = time.monotonic() + check_timeout(timeout, "poll: timeout")
        return self._req._done or self._mesh.progress(self._req, self._req.src, deadline)

    def wait(self, timeout: float | None = None) -> None:
        limit = self._mesh.timeout() if timeout is None else check_timeout(timeout,
                                                                            "recv: timeout")
        self.wait_until(time.monotonic() + limit, limit)

    def wait_until(self, deadline: float, limit: float) -> None:
        """:meth:`wait` with an absolute ``deadline`` (``limit``: the seconds to name in a
        timeout)."""
        req, mesh = self._req, self._mesh
        if not req._done and not mesh.progress(req, req.src, deadline):
            if mesh.withdraw(req):
                raise CollectiveTimeoutError(
                    f"recv: rank {mesh.rank} waited {limit:g}s for a message from rank "
                    f"{req.src} (tag {req.tag}, {len(req.view)} bytes)")
            req.wait(limit)  # claimed meanwhile: it completes (or fails) in a moment
        if req._error is not None:
            raise req._error
