"""One receive loop per process: every link's socket drained by a single epoll-driven thread.

The thread-per-peer reader (:func:`.framing.read_frames`) costs a thread for every connected
peer; at hundreds of ranks that is hundreds of threads per process, each waking for its own
socket. :class:`Reactor` keeps one thread whatever the world size. It waits in ``epoll`` (the
GIL released) for any readable link, then reads without blocking (``MSG_DONTWAIT``) as much as
the socket holds, frame by frame, with the same delivery rules as the reader threads:

* a DATA frame goes straight into the buffer of a posted receive (no copy), else into a new
  buffer queued in the mailbox; a frame of the wrong length is refused and skipped unallocated;
* a large frame (>= LARGE_FRAME) whose receive is not posted yet is *parked*: its link is left
  unread for up to LARGE_FRAME_WAIT seconds (the sender's bytes wait in the kernel) until the
  receive is posted (the mailbox's ``on_post`` wakes the loop at once), and only if no send of
  this process is stuck (``may_wait``), as the reader threads did; the other links keep flowing.
  Never while a receive from the same peer on another tag waits (``Mailbox.others_wait``): that
  frame may be behind the parked one, and collectives in flight at once (async workers, DDP's
  buckets, FSDP's gathers) would each sit out the wait in turn;
* ABORT, CLOSE, EOF and errors become failures on the mailbox; a peer that stops mid-frame
  (SIGSTOP) holds up only its own link.

A thread that waits for a receive reads the sockets itself while the loop thread steps aside
(:mod:`.lead`: one trip through the scheduler per message instead of two).
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from ..checks import size_mismatch
from ..errors import PeerClosedError, ProtocolError
from ..mailbox import CLOSED_CLEANLY, Mailbox, PostedRecv
from ..posted import ANY_SOURCE
from .framing import FRAME, K_ABORT, K_CLOSE, K_DATA, LARGE_FRAME, LARGE_FRAME_WAIT, Link, _sockio
from .incoming import DONE, HEADER, PARKED, PAYLOAD, Incoming, allocate
from .lead import Lead

#: bytes read from one link before the loop looks at the others (fairness)
_TURN = 4 << 20
_DONTWAIT = socket.MSG_DONTWAIT


class Reactor(Lead):
    """The receive loop of one TcpBackend (one thread, started at once)."""

    def __init__(self, rank: int, box: Mailbox, may_wait: Callable[[], bool]) -> None:
        self.rank, self.may_wait = rank, may_wait  # the mailbox: Lead's self.box
        self._ep = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._ep.register(self._wake_r, select.EPOLLIN)
        self._ep_fd = self._ep.fileno()
        self._lock = threading.Lock()
        self._new: list[Link] = []
        self._live: dict[int, Incoming] = {}  # fd -> state, links not finished yet
        self._by_peer: dict[int, Incoming] = {}  # peer -> the same states
        #: frames a waiting thread read straight into its receive (:meth:`_serve`)
        self.direct_frames = 0
        self._parked: dict[tuple[int, int], Incoming] = {}  # (peer, tag) -> parked link
        self._stop = False
        self._draining = False
        self._finished = False  # finish() ran: whoever ends last (it or the loop) releases
        self._released = False  # the epoll and the wake pipe are closed
        Lead.__init__(self, box, self._lock)
        box.on_post = self._posted
        box.driver = self
        box.add_failure_callback(self._wake)  # a leading waiter out of epoll at once
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"ferro-tcp-{rank}-loop")
        self._thread.start()

    # ------------------------------------------------------------------ control
    def add(self, link: Link) -> None:
        """Start draining ``link`` (any thread)."""
        with self._lock:
            self._new.append(link)
        self._wake()

    def _wake(self) -> None:
        if self._wake_w < 0:
            return  # finished
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    def _posted(self, src: int, tag: int) -> None:
        """Mailbox hook: a receive was posted; wake the loop if its frame is parked, or if a
        frame parked on the same link (another tag) may hold up the one it waits for."""
        parked = self._parked
        if parked and (src == ANY_SOURCE or any(peer == src for peer, _ in list(parked))):
            self._wake()

    def finish(self, wait: float) -> None:
        """Give the peers ``wait`` seconds to say goodbye (every link to end), then stop the
        loop. Sockets stay open (the caller closes them after this returns)."""
        self._draining = True
        self._rouse()
        self._thread.join(max(0.0, wait))
        self._stop = True
        self._rouse()
        self._thread.join(1.0)
        if self.box.on_post == self._posted:
            self.box.on_post = None
        if self.box.driver is self:
            self.box.driver = None
        self._finished = True
        if not self._thread.is_alive():
            self._release()
        # else the loop thread, late on a loaded host, releases them as it ends (_run)

    def _release(self) -> None:
        """Close the epoll and the wake pipe once, when neither the loop thread nor a waiting
        thread reads them any more (they see _stop); the lead stays taken, so none leads again."""
        if self._released or not self._lead.acquire(timeout=1.0):
            return
        self._released = True
        self._ep.close()
        wake_w, self._wake_w = self._wake_w, -1
        for fd in (self._wake_r, wake_w):
            os.close(fd)

    def _rouse(self) -> None:  # the loop thread, from epoll or its rest
        self._wake()
        with self._rest:
            self._rest.notify_all()

    threads = 1  # whatever the world size

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            if self._finished:  # finish() gave up joining this thread: release for it
                self._release()

    def _loop(self) -> None:
        while not self._stop:
            if self._draining and not self._live and not self._new:
                return
            aside = self._aside_for()
            if aside is not None:
                with self._rest:
                    if not self._stop:
                        self._rest.wait(aside)
                continue
            with self._lead:
                if self._aside_for() is not None:
                    continue  # a waiting thread led meanwhile
                self._loop_leads = True
                try:
                    self._turn(None)
                finally:
                    self._loop_leads = False

    def _turn(self, cap: float | None) -> None:
        """One turn of the loop (the lead held): wait up to ``cap`` seconds (None: until
        something happens) for a readable link, then read what the links hold."""
        ep, live, wake_r = self._ep, self._live, self._wake_r
        timeout = -1.0 if cap is None else max(0.0, cap)
        if self._parked:
            now = time.monotonic()
            park = max(0.0, min(min(p.parked_until for p in self._parked.values()) - now, 1e-3))
            timeout = park if timeout < 0 else min(timeout, park)
        for fd, _ in ep.poll(timeout):
            inc = live.get(fd)
            if inc is not None:
                self._drain(inc)
            elif fd == wake_r:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
        if self._new:
            with self._lock:
                new, self._new = self._new, []
            for link in new:
                inc = Incoming(link)
                live[inc.fd] = inc
                self._by_peer[link.peer] = inc
                ep.register(inc.fd, select.EPOLLIN)
                self._drain(inc)  # bytes may have arrived before registration
        if self._parked:
            self._unpark()

    def _serve(self, req: PostedRecv, cap: float) -> None:
        """One turn for a thread that waits for ``req`` (the lead held): when nothing else is
        pending, wait on ``req``'s peer alone (and on epoll, for the other links and wake-ups)
        and, if its next frame is ``req``'s, read it straight into ``req`` (compiled: 12-13 us
        from a readable socket to the receive's return here, 20 through the general turn);
        else the general turn."""
        inc = self._by_peer.get(req.src) if _sockio is not None else None
        if inc is None or inc.state != HEADER or inc.got or self._parked or self._new \
                or len(req.view) >= LARGE_FRAME:
            self._turn(cap)
            return
        answer = _sockio.peek_frame(inc.fd, self._ep_fd, inc.header, cap)
        if answer == _sockio.TIMEOUT:
            return
        if answer == _sockio.PEEKED:
            kind, tag, length = FRAME.unpack(inc.header)
            if kind == K_DATA and tag == req.tag and length == len(req.view) \
                    and self.box.claim_first(req):
                got = _sockio.take_frame(inc.fd, self._ep_fd, req.view, cap)
                if got == length:
                    inc.link.received += length
                    self.direct_frames += 1
                    req.complete()
                    return
                # the rest is on its way (or the link ended): the general path goes on
                inc.kind, inc.tag, inc.length = K_DATA, tag, length
                inc.req, inc.skip, inc.buf, inc.view = req, False, None, req.view
                inc.state, inc.got = PAYLOAD, max(got, 0)
                if got < 0:
                    self._lost(inc, ProtocolError(f"recv: rank {self.rank} <- {req.src}: a "
                                                  "frame header read by two readers"))
                return
        self._turn(0.0)  # another link, a wake-up, a frame for someone else: the general path

    def _unpark(self) -> None:
        now = time.monotonic()
        can_wait = self.may_wait()
        for key, inc in list(self._parked.items()):
            req = self.box.claim(inc.link.peer, inc.tag)
            if req is not None or now >= inc.parked_until or not can_wait \
                    or self.box.others_wait(inc.link.peer, inc.tag):
                del self._parked[key]
                try:
                    self._begin_payload(inc, req)
                except ProtocolError as exc:
                    self._lost(inc, exc)
                    continue
                self._ep.register(inc.fd, select.EPOLLIN)
                self._drain(inc)

    def _drain(self, inc: Incoming) -> None:
        """Read what ``inc``'s socket holds (up to a turn), delivering complete frames. A read
        that comes back short means the socket is empty: epoll (level-triggered) says when
        more arrives, so no read ends in EAGAIN on the common path."""
        recv_into = inc.link.sock.recv_into
        budget = _TURN
        try:
            while budget > 0:
                state = inc.state
                if state == HEADER:
                    want = FRAME.size - inc.got
                    k = recv_into(inc.header[inc.got:], want, _DONTWAIT)
                    if k == 0:
                        raise EOFError("connection closed")
                    inc.got += k
                    if k < want:
                        return
                    self._on_header(inc)
                elif state == PAYLOAD:
                    rem = min(inc.length - inc.got, budget)
                    chunk = inc.view[:min(rem, len(inc.view))] if inc.skip else \
                        inc.view[inc.got:inc.got + rem]
                    want = len(chunk)
                    k = recv_into(chunk, want, _DONTWAIT)
                    if k == 0:
                        raise EOFError(f"connection closed with {inc.length - inc.got} bytes of "
                                       "a frame unread")
                    inc.got += k
                    budget -= k
                    if inc.got == inc.length:
                        self._on_payload(inc)
                        return  # back to epoll: its waiter takes the GIL now, not after a read
                    if k < want:
                        return
                else:
                    return
        except BlockingIOError:
            return
        except (OSError, EOFError, ProtocolError, ValueError) as exc:
            self._lost(inc, exc)

    def _on_header(self, inc: Incoming) -> None:
        kind, tag, length = FRAME.unpack(inc.header)
        inc.kind, inc.tag, inc.length = kind, tag, length
        if kind == K_DATA:
            req = self.box.claim(inc.link.peer, tag)
            if req is None and length >= LARGE_FRAME and self.may_wait() \
                    and not self.box.others_wait(inc.link.peer, tag):
                inc.state = PARKED
                inc.parked_until = time.monotonic() + LARGE_FRAME_WAIT
                self._parked[(inc.link.peer, tag)] = inc
                self._ep.unregister(inc.fd)
                return
            self._begin_payload(inc, req)
        elif kind == K_ABORT:
            inc.req = None
            inc.buf = np.empty(min(length, 1 << 16), dtype=np.uint8)
            inc.view = memoryview(inc.buf)
            inc.skip = False
            inc.state, inc.got, inc.length = PAYLOAD, 0, len(inc.view)
            if inc.length == 0:
                self._on_payload(inc)
        elif kind == K_CLOSE:
            self._end(inc, CLOSED_CLEANLY)
        else:
            raise ProtocolError(f"frame of unknown kind {kind} from rank {inc.link.peer}")

    def _begin_payload(self, inc: Incoming, req: PostedRecv | None) -> None:
        length = inc.length
        inc.req, inc.skip, inc.buf = req, False, None
        if req is None:
            inc.buf = allocate(length, inc.link.peer, self.rank, inc.tag)
            inc.view = memoryview(inc.buf)
        elif len(req.view) != length:
            inc.skip = True
            inc.buf = np.empty(min(length, 1 << 20), dtype=np.uint8)
            inc.view = memoryview(inc.buf)
        else:
            inc.view = req.view
        inc.state, inc.got = PAYLOAD, 0
        if length == 0:
            self._on_payload(inc)

    def _on_payload(self, inc: Incoming) -> None:
        link, peer = inc.link, inc.link.peer
        link.received += inc.length if inc.kind == K_DATA else 0
        if inc.kind == K_ABORT:
            self.box.abort(peer, bytes(inc.view).decode(errors="replace"))
            self._end(inc, None)
            return
        req = inc.req
        if inc.skip:
            req.fail(size_mismatch("recv", peer, self.rank, inc.tag, len(req.view), inc.length))
        elif req is None:
            self.box.deliver(peer, inc.tag, inc.buf)
        else:
            req.complete()
        inc.req = inc.buf = inc.view = None
        inc.state, inc.got = HEADER, 0

    def _end(self, inc: Incoming, why: str | None) -> None:
        """``inc``'s link is finished (CLOSE, ABORT, EOF or an error)."""
        inc.state = DONE
        self._live.pop(inc.fd, None)
        if self._by_peer.get(inc.link.peer) is inc:
            del self._by_peer[inc.link.peer]
        try:
            self._ep.unregister(inc.fd)
        except (OSError, ValueError):
            pass
        if why is not None:
            self.box.peer_closed(inc.link.peer, why)

    def _lost(self, inc: Incoming, exc: BaseException) -> None:
        peer = inc.link.peer
        why = "the process died or closed the connection" if isinstance(
            exc, EOFError | ConnectionResetError) else str(exc)
        if inc.state == PAYLOAD and inc.req is not None:  # claimed, refused (skip) or not
            inc.req.fail(PeerClosedError(
                f"recv: rank {self.rank} <- {peer}: connection lost mid-message ({why})",
                peer=peer))
        self._end(inc, why)

