"""A multi-process backend over TCP: a full mesh of authenticated connections.

Set-up (rendezvous):

1. Rank 0 listens on ``master_addr``. Every other rank connects to it, opens a listener of its
   own, and announces ``(rank, world_size, listen address)``.
2. Rank 0 sends everyone the address table; rank ``i`` connects to each rank ``0 < j < i`` and
   accepts from each rank ``j > i``. The connection to rank 0 is kept as the ``(0, i)`` link.

Every connection starts with a handshake: the protocol magic and version, then a mutual
HMAC-SHA256 challenge over fresh nonces keyed by the job's ``token`` (argument or ``FERRO_TOKEN``).
A process that does not know the token gets :class:`AuthenticationError`; the job goes on.

Data path: frames of ``(kind, tag, length)`` with 64-bit lengths, then the payload. One reader
thread per peer drains its socket: into the buffer of a posted receive when there is one
(``recv_into`` straight into the caller's memory; a frame of the wrong length is refused and
skipped without allocating it), else into a queue. Because readers always drain, a send never
waits for the receiver to call ``recv``, and ring algorithms cannot deadlock. A dead peer's
socket reaches EOF, which fails every receive waiting for it at once; ``abort`` sends a frame that
fails every receive of the job.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from .base import (
    DEFAULT_TIMEOUT,
    Backend,
    Request,
    as_recv_view,
    as_send_view,
    check_peer,
    check_rank,
    check_tag,
    check_world_size,
    size_mismatch,
)
from .errors import (
    AuthenticationError,
    CollectiveTimeoutError,
    DistributedError,
    PeerAbortedError,
    PeerClosedError,
    ProtocolError,
    RendezvousError,
)
from .mailbox import Mailbox

log = logging.getLogger("ferro_backend.tcp")

MAGIC = b"FERRO\x00"
PROTOCOL_VERSION = 1
_HELLO = struct.Struct("<6sH32s")  # magic, version, nonce
_AUTH = struct.Struct("<32s")  # HMAC-SHA256
_INFO = struct.Struct("<IIHH")  # rank, world_size, listen port, host length
_STATUS = struct.Struct("<BH")  # status, message length
_FRAME = struct.Struct("<B7xQQ")  # kind, tag, length

ST_OK, ST_AUTH, ST_BAD = 0, 1, 2
K_DATA, K_ABORT, K_CLOSE = 1, 2, 3

SOCKET_BUFFER = 4 << 20
#: a frame this large with no receive posted yet waits up to LARGE_FRAME_WAIT seconds for one,
#: so it lands in the caller's buffer instead of a temporary one (bounded: never a deadlock)
LARGE_FRAME = 256 << 10
LARGE_FRAME_WAIT = 0.05
_CHUNK = 1 << 30
_SEND_POLL = 0.25  # seconds a blocked send waits before re-checking timeouts and aborts


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"master_addr {addr!r} is not 'host:port'")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:  # pragma: no cover - a kernel may refuse the size
            pass


def _mac(key: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, b"ferro-auth-v1|" + role + a + b, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} handshake bytes")
        got += k
    return bytes(buf)


def _send_status(sock: socket.socket, status: int, message: str = "") -> None:
    data = message.encode()[:60000]
    sock.sendall(_STATUS.pack(status, len(data)) + data)


def _recv_status(sock: socket.socket) -> tuple[int, str]:
    status, n = _STATUS.unpack(_recv_exactly(sock, _STATUS.size))
    return status, _recv_exactly(sock, n).decode(errors="replace")


def _client_handshake(sock: socket.socket, key: bytes, info: bytes, where: str) -> None:
    """Client side of the handshake; raises AuthenticationError or ProtocolError."""
    nonce_c = secrets.token_bytes(32)
    sock.sendall(_HELLO.pack(MAGIC, PROTOCOL_VERSION, nonce_c))
    try:
        magic, version, nonce_s = _HELLO.unpack(_recv_exactly(sock, _HELLO.size))
    except ConnectionError as exc:
        raise AuthenticationError(f"{where}: the peer closed the connection during the "
                                  f"handshake ({exc}); is this a ferro job?") from exc
    if magic != MAGIC:
        raise ProtocolError(f"{where}: peer answered with magic {magic!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"{where}: peer speaks protocol {version}, this is {PROTOCOL_VERSION}")
    (mac_s,) = _AUTH.unpack(_recv_exactly(sock, _AUTH.size))
    sock.sendall(_mac(key, b"client", nonce_s, nonce_c))
    if not hmac.compare_digest(mac_s, _mac(key, b"server", nonce_c, nonce_s)):
        raise AuthenticationError(f"{where}: the peer does not know this job's token")
    status, message = _recv_status(sock)
    if status == ST_AUTH:
        raise AuthenticationError(f"{where}: rejected: {message}")
    sock.sendall(info)
    status, message = _recv_status(sock)
    if status != ST_OK:
        raise RendezvousError(f"{where}: rejected: {message}")


def _server_handshake(sock: socket.socket, key: bytes) -> None:
    """Server side up to the info; raises ProtocolError or AuthenticationError."""
    hello = _recv_exactly(sock, _HELLO.size)
    magic, version, nonce_c = _HELLO.unpack(hello)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    nonce_s = secrets.token_bytes(32)
    sock.sendall(_HELLO.pack(MAGIC, PROTOCOL_VERSION, nonce_s))
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
    sock.sendall(_mac(key, b"server", nonce_c, nonce_s))
    (mac_c,) = _AUTH.unpack(_recv_exactly(sock, _AUTH.size))
    if not hmac.compare_digest(mac_c, _mac(key, b"client", nonce_s, nonce_c)):
        _send_status(sock, ST_AUTH, "wrong token")
        raise AuthenticationError("a client with the wrong token")
    _send_status(sock, ST_OK)


def _encode_info(rank: int, world_size: int, host: str, port: int) -> bytes:
    h = host.encode()
    return _INFO.pack(rank, world_size, port, len(h)) + h


def _decode_info(sock: socket.socket) -> tuple[int, int, str, int]:
    rank, world, port, n = _INFO.unpack(_recv_exactly(sock, _INFO.size))
    return rank, world, _recv_exactly(sock, n).decode(), port


class TcpBackend(Backend):
    """One rank of a multi-process job over TCP (full mesh).

    Parameters
    ----------
    rank, world_size
        This process's rank and the number of processes.
    master_addr
        ``"host:port"`` where rank 0 listens for the rendezvous.
    timeout
        Default timeout, in seconds, of blocking calls and of the rendezvous.
    token
        Shared secret; every connection proves knowledge of it (HMAC challenge). Defaults to
        the ``FERRO_TOKEN`` environment variable; without one, connections are checked for the
        protocol magic and version only.
    connect_timeout
        Seconds the rendezvous may take (default: ``timeout``).

    Raises
    ------
    InvalidRankError, InvalidWorldSizeError
        Bad ``rank``/``world_size``.
    RendezvousError
        The port is in use, rank 0 never came up, or a rank never joined (the message names the
        address, the port and the ranks).
    AuthenticationError
        This process's token is not the job's.
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, *,
                 timeout: float = DEFAULT_TIMEOUT, token: str | bytes | None = None,
                 connect_timeout: float | None = None) -> None:
        check_world_size(world_size)
        check_rank(rank, world_size)
        self._rank = rank
        self._world = world_size
        self.timeout = float(timeout)
        if token is None:
            token = os.environ.get("FERRO_TOKEN")
        self._key = token.encode() if isinstance(token, str) else (token or b"")
        self.master_addr = master_addr
        self._host, self._port = parse_addr(master_addr)
        self._box = Mailbox(rank, self.timeout)
        self._socks: dict[int, socket.socket] = {}
        self._send_locks = {p: threading.Lock() for p in range(world_size) if p != rank}
        self._readers: list[threading.Thread] = []
        self._state_lock = threading.Lock()
        self._closed = False
        self._aborted: tuple[int, str] | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        deadline = time.monotonic() + (self.timeout if connect_timeout is None
                                       else connect_timeout)
        if world_size > 1:
            try:
                self._rendezvous(deadline)
            except BaseException:
                for s in self._socks.values():
                    s.close()
                raise
            for peer, sock in self._socks.items():
                t = threading.Thread(target=self._reader, args=(peer, sock), daemon=True,
                                     name=f"ferro-tcp-{rank}<-{peer}")
                t.start()
                self._readers.append(t)

    @classmethod
    def from_env(cls, **kwargs: Any) -> TcpBackend:
        """Build from the torchrun variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        (and FERRO_TOKEN, FERRO_TIMEOUT when set); keyword arguments override."""
        env = os.environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing and not {"rank", "world_size", "master_addr"} <= kwargs.keys():
            raise RendezvousError(f"TcpBackend.from_env: environment variables {missing} are unset"
                                  " (run under ferrorun or torchrun)")
        rank = kwargs.pop("rank", None)
        world = kwargs.pop("world_size", None)
        addr = kwargs.pop("master_addr", None)
        if "FERRO_TIMEOUT" in env:
            kwargs.setdefault("timeout", float(env["FERRO_TIMEOUT"]))
        return cls(int(env["RANK"]) if rank is None else rank,
                   int(env["WORLD_SIZE"]) if world is None else world,
                   f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" if addr is None else addr,
                   **kwargs)

    # ------------------------------------------------------------------ rendezvous
    def _listen(self, host: str, port: int) -> socket.socket:
        lsock = socket.socket(_family(host), socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _tune(lsock)
        try:
            lsock.bind((host, port))
        except OSError as exc:
            lsock.close()
            raise RendezvousError(
                f"rank {self._rank}: cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        lsock.listen(max(16, self._world))
        return lsock

    def _connect(self, host: str, port: int, deadline: float, peer: int, listen_port: int = 0
                 ) -> socket.socket:
        delay = 0.02
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousError(
                    f"rank {self._rank}: rank {peer} did not come up at {host}:{port} "
                    f"within the connect timeout"
                )
            sock = socket.socket(_family(host), socket.SOCK_STREAM)
            _tune(sock)
            sock.settimeout(max(0.05, min(remaining, 5.0)))
            try:
                sock.connect((host, port))
            except OSError:
                sock.close()
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
                continue
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            info = _encode_info(self._rank, self._world, "", listen_port)
            try:
                _client_handshake(sock, self._key, info, f"rank {self._rank} -> rank {peer} at "
                                  f"{host}:{port}")
            except TimeoutError as exc:
                sock.close()
                raise RendezvousError(f"rank {self._rank}: handshake with rank {peer} at "
                                      f"{host}:{port} timed out") from exc
            except BaseException:
                sock.close()
                raise
            return sock

    def _accept(self, lsock: socket.socket, expected: set[int], deadline: float,
                on_join=None) -> dict[int, tuple[socket.socket, str, int]]:
        """Accept authenticated connections until every rank in ``expected`` has joined."""
        joined: dict[int, tuple[socket.socket, str, int]] = {}
        host, port = lsock.getsockname()[:2]
        while len(joined) < len(expected):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for s, _, _ in joined.values():
                    s.close()
                missing = sorted(expected - joined.keys())
                raise RendezvousError(
                    f"rank {self._rank} listening on {host}:{port}: ranks {missing} did not "
                    f"join within the connect timeout"
                )
            lsock.settimeout(remaining)
            try:
                sock, peer_addr = lsock.accept()
            except TimeoutError:
                continue
            sock.settimeout(max(0.05, min(remaining, 10.0)))
            try:
                _server_handshake(sock, self._key)
                prank, pworld, phost, pport = _decode_info(sock)
                problem = None
                if pworld != self._world:
                    problem = f"world_size {pworld} differs from this job's {self._world}"
                elif prank not in expected:
                    problem = f"rank {prank} is not expected here (expected {sorted(expected)})"
                elif prank in joined:
                    problem = f"rank {prank} joined twice"
                if problem:
                    _send_status(sock, ST_BAD, problem)
                    raise ProtocolError(problem)
                _send_status(sock, ST_OK)
            except (ProtocolError, AuthenticationError, OSError, struct.error) as exc:
                log.warning("rank %d: refused a connection from %s: %s", self._rank,
                            peer_addr, exc)
                sock.close()
                continue
            joined[prank] = (sock, phost or peer_addr[0], pport)
        return joined

    def _rendezvous(self, deadline: float) -> None:
        rank, world = self._rank, self._world
        if rank == 0:
            lsock = self._listen(self._host, self._port)
            try:
                joined = self._accept(lsock, set(range(1, world)), deadline)
            finally:
                lsock.close()
            table = {r: (h, p) for r, (_, h, p) in joined.items()}
            payload = json.dumps({str(r): hp for r, hp in table.items()}).encode()
            for r, (sock, _, _) in joined.items():
                self._socks[r] = sock
                sock.sendall(struct.pack("<Q", len(payload)) + payload)
        else:
            # Listen first (on loopback for a loopback job, else on every interface); rank 0
            # tells the others the address it saw this rank connect from.
            loopback = self._host.startswith("127.") or self._host in ("localhost", "::1")
            wildcard = "::" if _family(self._host) == socket.AF_INET6 else "0.0.0.0"
            lsock = self._listen(self._host if loopback else wildcard, 0)
            try:
                port = lsock.getsockname()[1]
                master = self._connect(self._host, self._port, deadline, 0, port)
                self._socks[0] = master
                master.settimeout(max(0.05, deadline - time.monotonic()))
                try:
                    (n,) = struct.unpack("<Q", _recv_exactly(master, 8))
                    raw = json.loads(_recv_exactly(master, n))
                except (OSError, ValueError) as exc:
                    raise RendezvousError(f"rank {rank}: no address table from rank 0 at "
                                          f"{self.master_addr}: {exc}") from exc
                table = {int(r): (h, p) for r, (h, p) in raw.items()}
                for peer in range(1, rank):
                    host, pport = table[peer]
                    self._socks[peer] = self._connect(host, pport, deadline, peer, port)
                if rank < world - 1:
                    joined = self._accept(lsock, set(range(rank + 1, world)), deadline)
                    for r, (sock, _, _) in joined.items():
                        self._socks[r] = sock
            finally:
                lsock.close()
        for sock in self._socks.values():
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            struct.pack("ll", int(_SEND_POLL), int(_SEND_POLL % 1 * 1e6)))

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    # ------------------------------------------------------------------ data path
    def _check_peer(self, op: str, peer: int, what: str) -> None:
        check_peer(op, peer, self._rank, self._world, what)

    def _raise_if_failed(self, op: str, peer: int) -> None:
        if self._aborted is not None:
            who, reason = self._aborted
            raise PeerAbortedError(f"{op}: rank {who} aborted the job: {reason}", peer=who,
                                   reason=reason)
        if self._closed:
            raise PeerClosedError(f"{op}: rank {self._rank}'s backend is closed", peer=self._rank)
        with self._box.cond:
            why = self._box.closed_peers.get(peer)
        if why is not None:
            raise PeerClosedError(f"{op}: rank {self._rank} -> {peer}: peer is gone ({why})",
                                  peer=peer)

    def _send_frame(self, peer: int, kind: int, tag: int, view: memoryview,
                    deadline: float | None) -> None:
        sock = self._socks[peer]
        header = _FRAME.pack(kind, tag, len(view))
        parts = [memoryview(header), view]
        total = len(header) + len(view)
        sent = 0
        while sent < total:
            if sent < len(header):
                bufs = [parts[0][sent:], view[:_CHUNK]]
            else:
                off = sent - len(header)
                bufs = [view[off:off + _CHUNK]]
            try:
                n = sock.sendmsg(bufs)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                raise PeerClosedError(
                    f"send: rank {self._rank} -> {peer} (tag {tag}): connection lost "
                    f"({exc.strerror or exc})", peer=peer) from exc
            sent += n
            if n == 0 and kind == K_DATA:
                self._raise_if_failed("send", peer)
                if deadline is not None and time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"send: rank {self._rank} -> {peer} (tag {tag}): {sent} of {total} "
                        f"bytes sent before the timeout of {self.timeout:g}s"
                    )
            elif n == 0 and deadline is not None and time.monotonic() > deadline:
                raise CollectiveTimeoutError(f"send: control frame to rank {peer} timed out")

    def send(self, data: Any, dst: int, *, tag: int = 0) -> None:
        self._check_peer("send", dst, "dst")
        check_tag(tag)
        view = as_send_view(data)
        self._raise_if_failed("send", dst)
        with self._send_locks[dst]:
            self._send_frame(dst, K_DATA, tag, view, time.monotonic() + self.timeout)
        self.bytes_sent += len(view)

    def irecv(self, out: Any, src: int, *, tag: int = 0) -> Request:
        self._check_peer("recv", src, "src")
        check_tag(tag)
        return self._box.post(src, tag, as_recv_view(out))

    def recv(self, out: Any, src: int, *, tag: int = 0, timeout: float | None = None) -> None:
        self.irecv(out, src, tag=tag).wait(timeout)

    def _read_exact(self, sock: socket.socket, view: memoryview) -> None:
        n = len(view)
        got = 0
        while got < n:
            k = sock.recv_into(view[got:], min(n - got, _CHUNK))
            if k == 0:
                raise EOFError(f"connection closed with {n - got} bytes of a frame unread")
            got += k
        self.bytes_received += n

    def _discard(self, sock: socket.socket, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            k = min(n, len(scratch))
            self._read_exact(sock, scratch[:k])
            n -= k

    def _reader(self, peer: int, sock: socket.socket) -> None:
        box = self._box
        header = memoryview(bytearray(_FRAME.size))
        current = None
        try:
            while True:
                self._read_exact(sock, header)
                kind, tag, length = _FRAME.unpack(header)
                if kind == K_DATA:
                    current = box.claim(peer, tag)
                    if current is None and length >= LARGE_FRAME:
                        current = box.claim_wait(peer, tag, LARGE_FRAME_WAIT)
                    if current is None:
                        buf = np.empty(length, dtype=np.uint8)  # no zero-fill
                        self._read_exact(sock, memoryview(buf))
                        box.deliver(peer, tag, buf)
                    elif len(current.view) != length:
                        # Refuse without allocating: skip the payload in small pieces.
                        self._discard(sock, length)
                        current.fail(size_mismatch("recv", peer, self._rank, tag,
                                                   len(current.view), length))
                    else:
                        self._read_exact(sock, current.view)
                        current.complete()
                    current = None
                elif kind == K_ABORT:
                    payload = bytearray(min(length, 1 << 16))
                    self._read_exact(sock, memoryview(payload))
                    reason = payload.decode(errors="replace")
                    with self._state_lock:
                        if self._aborted is None:
                            self._aborted = (peer, reason)
                    box.abort(peer, reason)
                    return
                elif kind == K_CLOSE:
                    box.peer_closed(peer, "it closed its backend")
                    return
                elif not self._extra_frame(peer, sock, kind, tag, length):
                    raise ProtocolError(f"frame of unknown kind {kind} from rank {peer}")
        except (OSError, EOFError, ProtocolError, ValueError) as exc:
            why = "the process died or closed the connection" if isinstance(
                exc, EOFError | ConnectionResetError) else str(exc)
            if current is not None:
                current.fail(PeerClosedError(
                    f"recv: rank {self._rank} <- {peer}: connection lost mid-message ({why})",
                    peer=peer))
            box.peer_closed(peer, why)

    def _extra_frame(self, peer: int, sock: socket.socket, kind: int, tag: int,
                     length: int) -> bool:
        """Handle a frame kind this class does not know (subclasses extend the protocol)."""
        return False

    # ------------------------------------------------------------------ teardown
    def abort(self, reason: str) -> None:
        """Tell every peer that this rank failed, then close. Peers' blocked calls raise
        :class:`PeerAbortedError` naming this rank and ``reason``."""
        with self._state_lock:
            if self._closed:
                return
            if self._aborted is None:
                self._aborted = (self._rank, reason)
        payload = memoryview(reason.encode()[:60000])
        for peer in list(self._socks):
            try:
                with self._send_locks[peer]:
                    self._send_frame(peer, K_ABORT, 0, payload, time.monotonic() + 1.0)
            except (DistributedError, OSError):
                pass
        self._box.abort(self._rank, reason)
        self._teardown(wait=0.0)

    def close(self) -> None:
        """Say goodbye to every peer and release the sockets. Idempotent."""
        with self._state_lock:
            if self._closed:
                return
        for peer in list(self._socks):
            try:
                with self._send_locks[peer]:
                    self._send_frame(peer, K_CLOSE, 0, memoryview(b""), time.monotonic() + 1.0)
                self._socks[peer].shutdown(socket.SHUT_WR)
            except (DistributedError, OSError):
                pass
        self._teardown(wait=0.5)

    def _teardown(self, wait: float) -> None:
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        end = time.monotonic() + wait
        for t in self._readers:
            t.join(max(0.0, end - time.monotonic()))
        for sock in self._socks.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for t in self._readers:
            t.join(1.0)
        self._box.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self._teardown(wait=0.0)
        except Exception:
            pass


