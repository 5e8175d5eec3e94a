"""The receiving side of the engine's rings: entries into receives, or into the mailbox.

Nobody polls on a receiver's behalf: a thread in ``recv`` drains the ring from its source itself
(spinning briefly, then sleeping on a futex the sender wakes), delivering entries meant for other
receives into the mailbox as it goes. So that a sender never waits on a receiver that has not
posted yet (the Backend contract), a sender about to sleep rings the receiver's doorbell, and
the receiver's *watch* thread (``_watch.pyx``), asleep on it without the GIL, moves entries that
then sit unconsumed for a whole period (1 ms) into the mailbox's queue of unexpected messages.
A receive first drains what its peer sent before the peer went away, then raises its failure.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..base import GROUP_TAG_SHIFT, Request
from ..checks import as_recv_view, check_timeout, size_mismatch
from ..errors import CollectiveTimeoutError, DistributedError, PeerClosedError, ProtocolError
from ..mailbox import Mailbox, PostedRecv
from . import _ring, _segment
from .segment import Engine

#: how long entries must sit unconsumed after a doorbell before the watch thread moves them
WATCH_PERIOD = 1e-3
#: seconds of one wait while another peer's failure is known (the failure flag is up for good)
DEGRADED_SLICE = 0.05
#: the longest one wait for a ring's data lasts (then the receive looks whether it was ended:
#: ``Request.cancel``)
CANCEL_SLICE = 0.2
#: a drain waits this long for the next chunk of a message being streamed before it moves on
STREAM_IDLE = 0.02
_KINDS = (_ring.EAGER, _ring.CHUNK, _ring.CMA)
#: what the ring kernels and the buffers of unexpected messages raise on a corrupt entry
_CORRUPT = (RuntimeError, ValueError, MemoryError, OverflowError)


class Delivery:
    """Rank ``ranks[engine.rank]``'s incoming rings and what arrives on them; every rank it
    takes or names is a job rank (``ranks[i]`` is the job rank of the segment's rank ``i``)."""

    def __init__(self, engine: Engine, box: Mailbox, ranks: Sequence[int]) -> None:
        me = engine.rank
        self.rank, self.box = ranks[me], box
        self.pids = {ranks[i]: pid for i, pid in enumerate(engine.pids)}
        local = [i for i in range(engine.nranks) if i != me]
        self._peers = [ranks[i] for i in local]
        #: job rank -> the ring from it, and the lock its drainer holds
        self.inc = {ranks[i]: engine.ring(i, me) for i in local}
        #: job rank -> the (head, tail) words of the ring from it (_layout.h's ferro_ring_ctrl:
        #: head at byte 0, tail at byte 64), read to check that an entry lies within what its
        #: producer published
        self._words = {ranks[i]: self._ring_words(engine, i, me) for i in local}
        self.locks = {ranks[i]: threading.Lock() for i in local}
        #: src -> [request or None, buffer or None]: a chunked message being received
        self._partial: dict[int, list] = {}
        self.received = 0
        self._stop = np.zeros(1, dtype=np.uint32)
        self._watch = engine.watch(local, self._stop)
        self._watcher = threading.Thread(target=self._watch_loop, daemon=True,
                                         name=f"ferro-shm-watch-{self.rank}")
        self._watcher.start()

    def recv_now(self, view, nbytes: int, src: int, tag: int,
                 deadline: float) -> bool | PostedRecv:
        """The common receive in one go: when no other thread drains the ring from ``src`` and
        nothing for ``(src, tag)`` is queued or posted, wait for the next entry and, if it is
        this receive's message, copy it straight into ``view``: True. False: not that case
        (nothing consumed; post and :meth:`progress` instead). A request: a chunked message
        partly received (:meth:`progress` completes it)."""
        lock = self.locks[src]
        if not lock.acquire(False):
            return False
        try:
            box, key = self.box, (src, tag)
            if box.unexpected.get(key) or box.posted.get(key) or box.posted_any.get(tag):
                return False  # queued, or a receive posted earlier may take the message
            ring = self.inc[src]
            group = tag >> GROUP_TAG_SHIFT
            while True:
                entry = ring.peek()
                if entry is None:
                    # (in slices: a subgroup view closed meanwhile by another thread of this
                    # rank posts nothing this wait would notice)
                    until = min(deadline, time.monotonic() + CANCEL_SLICE)
                    rc = ring.wait_data(until)
                    if rc == _ring.READY:
                        continue
                    if rc == _ring.TIME_UP and time.monotonic() < deadline and not (
                            box.closed_groups and group in box.closed_groups):
                        continue
                    return False  # late, failing or closed: the general path says which
                kind, length, got_tag, total, aux = entry
                self._check_entry(ring, src, entry)
                if got_tag != tag or total != nbytes:
                    return False
                if kind == _ring.EAGER:
                    ring.take(view)
                elif kind == _ring.CMA:
                    self._read_into(ring, src, tag, view, aux)
                elif kind == _ring.CHUNK and aux == 0:
                    try:
                        _rc, reached = ring.take_stream(view, tag, 0, deadline)
                    except RuntimeError as exc:
                        raise self._corrupt(src, exc) from exc
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
        ring, lock, box = self.inc[src], self.locks[src], self.box
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
                    try:
                        self._drain(src)
                    except ProtocolError:
                        self.withdraw(req)
                        raise
                    if req._done:
                        return True
                    failure = box.failure("recv", src)
                    if failure is not None:
                        self._drain(src)  # what it sent before it went away is still there
                        if req._done:
                            return True
                        self.withdraw(req)
                        req.fail(failure)  # (for every waiter: done, with this error)
                        raise failure
                    now = time.monotonic()
                    if now >= deadline:
                        return False
                    # wakes at least every CANCEL_SLICE: a receive ended meanwhile (its group
                    # destroyed: Request.cancel) is noticed without a message
                    until = min(deadline, now + (CANCEL_SLICE if watch else DEGRADED_SLICE))
                    if ring.wait_data(until, watch) == _ring.FAILED:
                        watch = False  # another peer's failure: this pair goes on
            finally:
                lock.release()
                with box.cond:  # a receive waiting behind us may drain now
                    box.cond.notify_all()
        return True

    def streaming_in(self) -> bool:
        """Whether a message streamed to this rank is part-taken (its sender waits for the
        rest to be taken: a receive claimed it, or it is being kept for one)."""
        return bool(self._partial)

    def try_progress(self, src: int, idle: float = STREAM_IDLE) -> None:
        """Drain the ring from ``src`` if no other thread is at it (never waits for the lock);
        a streamed message's next chunk is waited for up to ``idle`` seconds (0: what is
        there)."""
        lock = self.locks[src]
        if self.inc[src].pending() and lock.acquire(False):
            try:
                self._drain(src, idle)
            finally:
                lock.release()

    def progress_all(self) -> None:
        """Take what every peer's ring holds now, into its receives or the mailbox, where no
        other thread is at that ring (never waits: a streamed message's next chunk included)."""
        for src in self._peers:
            self.try_progress(src, 0.0)

    def withdraw(self, req: PostedRecv) -> bool:
        """Take a pending receive back from the mailbox; False if a drain already claimed it
        (it completes shortly)."""
        return self.box.withdraw(req)

    @staticmethod
    def _ring_words(engine: Engine, src: int, dst: int) -> tuple[np.ndarray, np.ndarray]:
        lay = engine.layout
        at = lay["ring_off"] + (dst * engine.nranks + src) * lay["ring_stride"]
        seg = engine._view()
        return seg[at:at + 4].view(np.uint32), seg[at + 64:at + 68].view(np.uint32)

    def _corrupt(self, src: int, why: object) -> ProtocolError:
        return ProtocolError(f"recv: rank {self.rank} <- {src}: the ring from rank {src} is "
                             f"corrupt ({why})")

    def _check_entry(self, ring: _ring.Ring, src: int, entry: tuple) -> None:
        """ProtocolError unless ``entry`` (``peek()``'s) is one a producer can have written: a
        known kind, a payload within the ring's limit, a chunk within its message. Checked
        before anything is read or allocated from it."""
        kind, length, tag, total, aux = entry
        head, tail = self._words[src]
        published = (int(head[0]) - int(tail[0])) & 0xFFFFFFFF
        problem = None
        if published > ring.cap:
            problem = f"{published} bytes published in a ring of {ring.cap}"
        elif kind not in _KINDS:
            problem = f"an entry of unknown kind {kind}"
        elif length > ring.max_payload:
            problem = f"an entry of {length} bytes, at most {ring.max_payload}"
        elif (32 + length + 63) & ~63 > published:
            problem = f"an entry of {length} bytes, {published} bytes published"
        elif kind == _ring.EAGER and total != length:
            problem = f"an eager entry of {length} bytes for a message of {total}"
        elif kind == _ring.CHUNK and (length == 0 or aux + length > total):
            # no producer streams an empty chunk (nor a message of 0 bytes: it goes eager);
            # taken, one would be consumed by nothing and delivered again and again
            problem = f"a chunk of {length} bytes at offset {aux} of a message of {total}"
        if problem is not None:
            raise self._corrupt(src, f"{problem}, tag {tag}")

    def _drain(self, src: int, idle: float = STREAM_IDLE) -> None:
        """Move every entry of the ring from ``src`` into its receive (or the mailbox's queue
        of unexpected messages); the caller holds the ring's lock. ProtocolError if the ring
        holds an entry no producer writes (the segment is corrupt)."""
        try:
            self._drain_entries(src, idle)
        except DistributedError:
            raise
        except _CORRUPT as exc:
            raise self._corrupt(src, f"{type(exc).__name__}: {exc}") from exc

    def _drain_entries(self, src: int, idle: float) -> None:
        ring, box = self.inc[src], self.box
        while True:
            entry = ring.peek()
            if entry is None:
                return
            self._check_entry(ring, src, entry)
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
                self._chunk(ring, src, length, tag, total, aux, idle)
            else:
                self._read_remote(ring, src, tag, total, aux)

    def _chunk(self, ring: _ring.Ring, src: int, length: int, tag: int, total: int,
               offset: int, idle: float) -> None:
        box = self.box
        part = self._partial.get(src)
        if part is None:
            req = box.claim(src, tag)
            if req is None:  # unexpected: not zero-filled first (the chunks fill it all)
                part = [None, np.empty(total, dtype=np.uint8)]
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
            _rc, offset = ring.take_stream(target, tag, offset, time.monotonic() + idle)
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
            _segment.cma_read(self.pids[src], address, buf)
        except OSError as exc:
            ring.skip(exc.errno or 5)  # the sender (if alive) learns why
            if exc.errno == errno.EFAULT:  # memory the sender's process does not map
                raise self._corrupt(src, f"tag {tag}, address {address:#x}: {exc}") from exc
            raise PeerClosedError(f"recv: rank {self.rank} <- {src} (tag {tag}): cannot read "
                                  f"the sender's memory ({exc})", peer=src) from exc
        ring.skip(0)

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
        """Stop the watch thread."""
        self._watch.wake()
        if self._watcher is not threading.current_thread():
            self._watcher.join(2.0)


class RingRecv(Request):
    """A receive posted on a ring: waiting (or polling) drains the ring from its source."""

    __slots__ = ("_delivery", "_req", "_timeout")

    def __init__(self, delivery: Delivery, req: PostedRecv, timeout: Callable[[], float]) -> None:
        self._delivery, self._req, self._timeout = delivery, req, timeout

    @property
    def source(self) -> int | None:
        return self._req.source

    def cancel(self, error: BaseException) -> bool:
        return self._req.cancel(error)

    def is_completed(self) -> bool:
        if not self._req._done:
            self._delivery.try_progress(self._req.src)
        return self._req._done

    def poll(self, timeout: float = 0.0) -> bool:
        deadline = time.monotonic() + check_timeout(timeout, "poll: timeout")
        return self._req._done or self._delivery.progress(self._req, self._req.src, deadline)

    def wait(self, timeout: float | None = None) -> None:
        limit = self._timeout() if timeout is None else check_timeout(timeout, "recv: timeout")
        self.wait_until(time.monotonic() + limit, limit)

    def wait_until(self, deadline: float, limit: float) -> None:
        """:meth:`wait` with an absolute ``deadline`` (``limit``: the seconds to name in a
        timeout)."""
        req, delivery = self._req, self._delivery
        if not req._done and not delivery.progress(req, req.src, deadline):
            if delivery.withdraw(req):
                raise CollectiveTimeoutError(
                    f"recv: rank {delivery.rank} waited {limit:g}s for a message from rank "
                    f"{req.src} (tag {req.tag}, {len(req.view)} bytes)")
            req.wait(limit)  # claimed meanwhile: it completes (or fails) in a moment
        if req._error is not None:
            raise req._error
