"""Connections made on first use (the lazy mesh of :class:`~ferro_backend.TcpBackend`).

After the rendezvous every rank knows every rank's address and keeps its own listener open.
The first send to a peer, or the first receive posted for it, connects (the handshake of
:mod:`.handshake`, this rank's info included); an accept thread takes the connections peers make
to this rank. So a job opens only the pairs its algorithms use (a ring: two per rank; a
hierarchical job: the node's and the cross stage's), and a rank runs one reader thread per peer
it talks to, not per rank of the job.

**Crossing connections.** Two ranks often connect to each other at the same moment (each sends
to the other, or one sends while the other posts a receive). Both sides then keep the connection
the *lower* rank made: a rank that accepts a connection from a higher rank while its own to that
rank is in flight refuses it with :data:`~.handshake.ST_TAKEN`, and the higher rank, refused,
waits for the lower rank's connection to arrive through its accept thread. Data only flows on a
connection after its handshake's OK, which the acceptor sends after registering it, so every
message between two ranks travels on the one connection both keep (FIFO per pair and tag holds).

**Failures.** A peer that is gone refuses the connection (its listener closed with it): the
send or receive raises :class:`PeerClosedError` naming it. Once connected, a pair behaves as in
the full mesh (EOF, goodbye and abort frames on its connection).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

from ..errors import AuthenticationError, PeerClosedError, ProtocolError, RendezvousError
from .handshake import (
    ST_BAD,
    ST_CLOSED,
    ST_OK,
    ST_TAKEN,
    ConnectionTaken,
    PeerHasClosed,
    decode_info,
    send_status,
    server_handshake,
)
from .rendezvous import HANDSHAKE_TIMEOUT, connect_to

log = logging.getLogger("ferro_backend.tcp")
_ACCEPT_POLL = 0.2


class Connector:
    """One rank's connections on first use. ``register(peer, sock)`` turns a handshaken socket
    into the backend's link (and starts its reader); ``has(peer)`` says whether one exists."""

    def __init__(self, rank: int, world: int, key: bytes, listener: socket.socket,
                 table: list[tuple[str, int]], node: str,
                 register: Callable[[int, socket.socket], None],
                 has: Callable[[int], bool]) -> None:
        self.rank, self.world, self.key, self.node = rank, world, key, node
        self.table = table
        self.listener = listener
        self.port = listener.getsockname()[1]
        self._register, self._has = register, has
        self.cond = threading.Condition()
        self.connecting: set[int] = set()
        self.closed = False
        self.accepted = 0  # connections peers made to this rank (kept)
        self.made = 0  # connections this rank made (kept)
        listener.settimeout(_ACCEPT_POLL)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"ferro-tcp-accept-{rank}")
        self._thread.start()

    # ---- this rank connects ----
    def connect(self, peer: int, deadline: float) -> None:
        """Make sure a connection to ``peer`` exists (this thread connects, or waits for the one
        another thread or the peer is making): PeerClosedError if the peer is gone,
        RendezvousError if nothing is up by ``deadline``."""
        with self.cond:
            while not self._has(peer) and peer in self.connecting:
                if not self._wait(deadline):
                    break
            if self._has(peer):
                return
            if self.closed:
                raise PeerClosedError(f"rank {self.rank}: this backend is closed", peer=peer)
            self.connecting.add(peer)
        try:
            host, port = self.table[peer]
            try:
                sock = connect_to(host, port, deadline, self.rank, self.world, peer, self.port,
                                  self.key, self.node, retry=False)
            except ConnectionTaken:
                sock = None  # the peer keeps the connection it is making to us: wait for it
            except PeerHasClosed as exc:
                with self.cond:  # (a connection the peer made registers under the lock)
                    if self._has(peer):
                        return  # its goodbye or abort came on the one it made: read it there
                raise PeerClosedError(f"rank {self.rank} -> {peer}: rank {peer} at {host}:{port} "
                                      f"has closed its backend", peer=peer) from exc
            except OSError as exc:
                raise PeerClosedError(
                    f"rank {self.rank} -> {peer}: cannot connect to {host}:{port} "
                    f"({exc.strerror or exc}): the rank is gone or closed its backend",
                    peer=peer) from exc
            with self.cond:
                if sock is not None:
                    if self._has(peer):  # cannot happen (the peer refuses a second one)
                        sock.close()
                    else:
                        self._register(peer, sock)
                        self.made += 1
                self.connecting.discard(peer)
                self.cond.notify_all()
                while not self._has(peer):
                    if not self._wait(deadline):
                        raise RendezvousError(
                            f"rank {self.rank}: rank {peer} kept its own connection to this "
                            f"rank but it did not arrive by the deadline")
        finally:
            with self.cond:
                self.connecting.discard(peer)
                self.cond.notify_all()

    def _wait(self, deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self.cond.wait(min(left, 0.5))
        return True

    # ---- peers connect to this rank ----
    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, addr = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener closed
            sock.settimeout(HANDSHAKE_TIMEOUT)
            threading.Thread(target=self._greet, args=(sock, addr), daemon=True,
                             name=f"ferro-tcp-greet-{self.rank}").start()

    def _greet(self, sock: socket.socket, addr) -> None:
        try:
            server_handshake(sock, self.key)
            prank, pworld, _, _, _ = decode_info(sock)
            problem = None
            if pworld != self.world or not 0 <= prank < self.world or prank == self.rank:
                problem = (f"rank {prank} of a job of {pworld} does not belong to this job "
                           f"(rank {self.rank} of {self.world})")
            with self.cond:
                if problem is not None:
                    status = None
                elif self.closed:
                    status = ST_CLOSED
                elif self._has(prank) or (prank in self.connecting and prank > self.rank):
                    status = ST_TAKEN  # ours is (or will be) the one both keep
                else:
                    # the OK goes out before the link is registered: once registered, this
                    # rank's senders may write frames on it, which must follow the OK
                    send_status(sock, ST_OK)
                    self._register(prank, sock)
                    self.accepted += 1
                    status = ST_OK
                    self.cond.notify_all()
            if status is None:
                send_status(sock, ST_BAD, problem)
                raise ProtocolError(problem)
            if status == ST_CLOSED:
                send_status(sock, ST_CLOSED, f"rank {self.rank} has closed its backend")
                sock.close()
            if status == ST_TAKEN:
                send_status(sock, ST_TAKEN,
                            f"rank {self.rank} keeps its own connection to rank {prank}")
                sock.close()
        except (ProtocolError, AuthenticationError, OSError, struct.error) as exc:
            log.warning("rank %d: refused a connection from %s: %s", self.rank, addr, exc)
            sock.close()

    def close(self) -> None:
        """Stop accepting (the listener closes: a peer connecting now is refused)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        try:
            self.listener.close()
        except OSError:
            pass
        self._thread.join(2 * _ACCEPT_POLL + 1)
