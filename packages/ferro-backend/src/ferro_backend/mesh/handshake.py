"""The handshake every TCP connection of a ferro job starts with: protocol check and mutual auth.

Client and server exchange the protocol magic, version and a fresh 32-byte nonce each, then prove
knowledge of the job's token with HMAC-SHA256 over both nonces (a different role string per side,
so neither proof can be replayed as the other). A process that does not know the token gets
:class:`AuthenticationError`; the server refuses it and goes on accepting. After the proofs the
client announces ``(rank, world_size, listen port, host, node)`` and the server answers with a
status: OK, refused (:class:`RendezvousError`), or *taken* (:class:`ConnectionTaken`: a connection
made on first use crossed one the peer made to this rank at the same moment, and the peer's is
the one both keep).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct

from ..errors import AuthenticationError, ProtocolError, RendezvousError

MAGIC = b"FERRO\x00"
PROTOCOL_VERSION = 2
_HELLO = struct.Struct("<6sH32s")  # magic, version, nonce
_AUTH = struct.Struct("<32s")  # HMAC-SHA256
_INFO = struct.Struct("<IIHHH")  # rank, world_size, listen port, host and node lengths
_STATUS = struct.Struct("<BH")  # status, message length

ST_OK, ST_AUTH, ST_BAD, ST_TAKEN, ST_CLOSED = 0, 1, 2, 3, 4


class ConnectionTaken(RendezvousError):
    """The peer refused this connection because it keeps the one it made to this rank."""


class PeerHasClosed(RendezvousError):
    """The peer refused this connection because it has closed (or aborted) its backend: what
    it told this rank before, it told on a connection it made (the lazy mesh)."""


def _mac(key: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, b"ferro-auth-v1|" + role + a + b, hashlib.sha256).digest()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock``; ConnectionError if it closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} handshake bytes")
        got += k
    return bytes(buf)


def send_status(sock: socket.socket, status: int, message: str = "") -> None:
    data = message.encode()[:60000]
    sock.sendall(_STATUS.pack(status, len(data)) + data)


def _recv_status(sock: socket.socket) -> tuple[int, str]:
    status, n = _STATUS.unpack(recv_exactly(sock, _STATUS.size))
    return status, recv_exactly(sock, n).decode(errors="replace")


def client_handshake(sock: socket.socket, key: bytes, info: bytes, where: str) -> None:
    """Client side, up to the server's verdict on ``info``.

    Raises AuthenticationError (wrong token, or not a ferro peer), ProtocolError (another
    protocol or version) or RendezvousError (the server refused ``info``); ``where`` names the
    connection in those messages.
    """
    nonce_c = secrets.token_bytes(32)
    sock.sendall(_HELLO.pack(MAGIC, PROTOCOL_VERSION, nonce_c))
    try:
        magic, version, nonce_s = _HELLO.unpack(recv_exactly(sock, _HELLO.size))
    except ConnectionError as exc:
        raise AuthenticationError(f"{where}: the peer closed the connection during the "
                                  f"handshake ({exc}); is this a ferro job?") from exc
    if magic != MAGIC:
        raise ProtocolError(f"{where}: peer answered with magic {magic!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"{where}: peer speaks protocol {version}, this is {PROTOCOL_VERSION}")
    (mac_s,) = _AUTH.unpack(recv_exactly(sock, _AUTH.size))
    sock.sendall(_mac(key, b"client", nonce_s, nonce_c))
    if not hmac.compare_digest(mac_s, _mac(key, b"server", nonce_c, nonce_s)):
        raise AuthenticationError(f"{where}: the peer does not know this job's token")
    status, message = _recv_status(sock)
    if status == ST_AUTH:
        raise AuthenticationError(f"{where}: rejected: {message}")
    sock.sendall(info)
    status, message = _recv_status(sock)
    if status == ST_TAKEN:
        raise ConnectionTaken(f"{where}: {message}")
    if status == ST_CLOSED:
        raise PeerHasClosed(f"{where}: rejected: {message}")
    if status != ST_OK:
        raise RendezvousError(f"{where}: rejected: {message}")


def server_handshake(sock: socket.socket, key: bytes) -> None:
    """Server side up to the client's info; raises ProtocolError or AuthenticationError."""
    hello = recv_exactly(sock, _HELLO.size)
    magic, version, nonce_c = _HELLO.unpack(hello)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    nonce_s = secrets.token_bytes(32)
    sock.sendall(_HELLO.pack(MAGIC, PROTOCOL_VERSION, nonce_s))
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
    sock.sendall(_mac(key, b"server", nonce_c, nonce_s))
    (mac_c,) = _AUTH.unpack(recv_exactly(sock, _AUTH.size))
    if not hmac.compare_digest(mac_c, _mac(key, b"client", nonce_s, nonce_c)):
        send_status(sock, ST_AUTH, "wrong token")
        raise AuthenticationError("a client with the wrong token")
    send_status(sock, ST_OK)


def encode_info(rank: int, world_size: int, host: str, port: int, node: str = "") -> bytes:
    h, k = host.encode()[:4096], node.encode()[:4096]
    return _INFO.pack(rank, world_size, port, len(h), len(k)) + h + k


def decode_info(sock: socket.socket) -> tuple[int, int, str, int, str]:
    """``(rank, world_size, host, listen port, node)`` as the client announced them."""
    rank, world, port, n, k = _INFO.unpack(recv_exactly(sock, _INFO.size))
    try:
        host = recv_exactly(sock, n).decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"rank {rank} announced a host name of {n} bytes that is not "
                            f"UTF-8") from exc
    return rank, world, host, port, recv_exactly(sock, k).decode(errors="replace")
