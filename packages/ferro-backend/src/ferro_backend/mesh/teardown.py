"""Ending a TCP mesh: a goodbye (CLOSE) or a failure notice (ABORT) to every peer, then release.

``close`` says goodbye to every peer and half-closes each socket, so peers see a clean CLOSE
(not a death) and their receives from this rank fail with "it closed its backend". ``abort`` sends
the reason to every peer instead: every receive of the job fails with
:class:`PeerAbortedError` naming this rank and the reason. Both are best-effort: a peer that is
already gone is skipped. :func:`release` then joins the reader threads (briefly) and closes the
sockets.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable

from ..errors import DistributedError
from .framing import K_ABORT, K_CLOSE, Link

#: seconds a goodbye or abort frame may take per peer
CONTROL_FRAME_TIMEOUT = 1.0


def say_goodbye(links: Iterable[Link]) -> None:
    """CLOSE to every peer, then half-close: no more data from this rank."""
    for link in links:
        try:
            link.send_frame(K_CLOSE, 0, memoryview(b""),
                            time.monotonic() + CONTROL_FRAME_TIMEOUT)
            link.sock.shutdown(socket.SHUT_WR)
        except (DistributedError, OSError):
            pass


def send_abort(links: Iterable[Link], reason: str) -> None:
    """ABORT with ``reason`` (truncated to 60000 bytes) to every peer."""
    payload = memoryview(reason.encode()[:60000])
    for link in links:
        try:
            link.send_frame(K_ABORT, 0, payload, time.monotonic() + CONTROL_FRAME_TIMEOUT)
        except (DistributedError, OSError):
            pass


def release(links: Iterable[Link], readers: list[threading.Thread], wait: float) -> None:
    """Give readers ``wait`` seconds to see the peers' goodbyes, then close every socket."""
    links = list(links)
    end = time.monotonic() + wait
    for t in readers:
        t.join(max(0.0, end - time.monotonic()))
    for link in links:
        try:
            link.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        link.sock.close()
    for t in readers:
        t.join(1.0)
