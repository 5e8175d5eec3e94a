"""Frames on a TCP link, and the reader thread that drains one link into the rank's mailbox.

A frame is ``(kind, tag, length)`` (64-bit tag and length) followed by ``length`` payload bytes.
Kinds: ``DATA`` (a message), ``ABORT`` (the peer failed; payload: its reason), ``CLOSE`` (the
peer said goodbye).

One reader thread per peer drains its socket: into the buffer of a posted receive when there is
one (``recv_into`` straight into the caller's memory; a frame of the wrong length is refused and
skipped without allocating it), else into the mailbox's queue. Because readers always drain, a
send never waits for the receiver to call ``recv``, and ring algorithms cannot deadlock. A dead
peer's socket reaches EOF, which fails every receive waiting for it at once.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from ..checks import size_mismatch
from ..errors import CollectiveTimeoutError, PeerClosedError, ProtocolError
from ..mailbox import CLOSED_CLEANLY, Mailbox

if sys.platform.startswith("linux"):  # the compiled system calls (a broken build fails loudly)
    from . import _sockio
else:  # pragma: no cover - elsewhere the Python path alone
    _sockio = None

FRAME = struct.Struct("<B7xQQ")  # kind, tag, length
K_DATA, K_ABORT, K_CLOSE = 1, 2, 3

#: a frame this large with no receive posted yet waits up to LARGE_FRAME_WAIT seconds for one,
#: so it lands in the caller's buffer instead of a temporary one (bounded: never a deadlock)
LARGE_FRAME = 256 << 10
LARGE_FRAME_WAIT = 0.05
_CHUNK = 1 << 30
_NOW = socket.MSG_DONTWAIT
SEND_POLL = 0.25  # seconds a blocked send waits before re-checking timeouts and aborts
#: a payload this large goes in calls of its own after the header: the kernel copies one
#: buffer per call at twice the speed of a header-and-payload pair (64 MiB over 127.0.0.1:
#: 17-30 ms against 32-53 ms)
HEADER_APART_FROM = 64 << 10


class Link:
    """The connection to one peer: framed sends (one sender at a time), exact reads, counters."""

    def __init__(self, rank: int, peer: int, sock: socket.socket) -> None:
        self.rank, self.peer, self.sock = rank, peer, sock
        self.lock = threading.Lock()
        self.fd = sock.fileno()
        self.sent = 0  # payload bytes of DATA frames (and of messages sent other ways)
        self.received = 0
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(SEND_POLL), int(SEND_POLL % 1 * 1e6)))

    def send_frame(self, kind: int, tag: int, view: memoryview, deadline: float | None,
                   still_ok: Callable[[], None] = lambda: None,
                   on_block: Callable[[], None] | None = None) -> None:
        """Send one frame, holding the link's lock. While the socket is full, ``still_ok()`` is
        called every SEND_POLL seconds (it raises to give up) and the deadline is checked.
        ``on_block()``, if given, is called once before the send waits for room in the socket
        (until then every attempt returns at once with what fits)."""
        header = FRAME.pack(kind, tag, len(view))
        total = len(header) + len(view)
        apart = len(view) >= HEADER_APART_FROM
        sent = 0
        with self.lock:
            if _sockio is not None and not apart:  # one compiled sendmsg; the loop sends the rest
                sent = _sockio.send_frame(self.fd, kind, tag, view)
                if sent < 0:
                    raise PeerClosedError(
                        f"send: rank {self.rank} -> {self.peer} (tag {tag}): connection lost "
                        f"({os.strerror(-sent)})", peer=self.peer)
            while sent < total:
                if sent < len(header):
                    bufs = [memoryview(header)[sent:]] if apart else \
                        [memoryview(header)[sent:], view[:_CHUNK]]
                else:
                    off = sent - len(header)
                    bufs = [view[off:off + _CHUNK]]
                try:
                    n = self.sock.sendmsg(bufs, (), 0 if on_block is None else _NOW)
                except BlockingIOError:
                    n = 0
                except OSError as exc:
                    raise PeerClosedError(
                        f"send: rank {self.rank} -> {self.peer} (tag {tag}): connection lost "
                        f"({exc.strerror or exc})", peer=self.peer) from exc
                sent += n
                if on_block is not None and n < sum(map(len, bufs)):  # the socket is full
                    on_block()
                    on_block = None
                if n == 0:
                    still_ok()
                    if deadline is not None and time.monotonic() > deadline:
                        raise CollectiveTimeoutError(
                            f"send: rank {self.rank} -> {self.peer} (tag {tag}): {sent} of "
                            f"{total} bytes sent before the timeout")
        if kind == K_DATA:
            self.sent += len(view)

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` from the socket; EOFError if the peer closes first."""
        n = len(view)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], min(n - got, _CHUNK))
            if k == 0:
                raise EOFError(f"connection closed with {n - got} bytes of a frame unread")
            got += k
        self.received += n

    def discard(self, n: int) -> None:
        """Skip ``n`` payload bytes in small pieces (a refused frame is never allocated)."""
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            k = min(n, len(scratch))
            self.read_into(scratch[:k])
            n -= k


def read_frames(link: Link, box: Mailbox, may_wait: Callable[[], bool] | None = None) -> None:
    """The reader thread's loop for ``link``: deliver DATA frames into ``box``, turn ABORT,
    CLOSE, EOF and errors into failures on ``box``; a frame of another kind is a
    ProtocolError (the link is then closed). A large
    frame whose receive is not posted yet waits up to LARGE_FRAME_WAIT for it (while
    ``may_wait()``, if given: TcpBackend says no while a send of its own is stuck)."""
    peer, rank = link.peer, link.rank
    header = memoryview(bytearray(FRAME.size))
    current = None
    try:
        while True:
            link.read_into(header)
            kind, tag, length = FRAME.unpack(header)
            if kind == K_DATA:
                current = box.claim(peer, tag)
                if current is None and length >= LARGE_FRAME:
                    current = box.claim_wait(peer, tag, LARGE_FRAME_WAIT, may_wait)
                if current is None:
                    buf = np.empty(length, dtype=np.uint8)  # no zero-fill
                    link.read_into(memoryview(buf))
                    box.deliver(peer, tag, buf)
                elif len(current.view) != length:
                    link.discard(length)
                    current.fail(size_mismatch("recv", peer, rank, tag, len(current.view),
                                               length))
                else:
                    link.read_into(current.view)
                    current.complete()
                current = None
            elif kind == K_ABORT:
                payload = bytearray(min(length, 1 << 16))
                link.read_into(memoryview(payload))
                box.abort(peer, payload.decode(errors="replace"))
                return
            elif kind == K_CLOSE:
                box.peer_closed(peer, CLOSED_CLEANLY)
                return
            else:
                raise ProtocolError(f"frame of unknown kind {kind} from rank {peer}")
    except (OSError, EOFError, ProtocolError, ValueError, MemoryError) as exc:
        why = "the process died or closed the connection" if isinstance(
            exc, EOFError | ConnectionResetError) else str(exc)
        if current is not None:
            current.fail(PeerClosedError(
                f"recv: rank {rank} <- {peer}: connection lost mid-message ({why})", peer=peer))
        box.peer_closed(peer, why)
