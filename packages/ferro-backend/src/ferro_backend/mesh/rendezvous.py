"""Building a TCP job's full mesh of authenticated connections (the rendezvous).

1. Rank 0 listens on ``master_addr``. Every other rank opens a listener of its own, connects to
   rank 0 and announces ``(rank, world_size, listen port)``.
2. Rank 0 sends everyone the table of every rank's address (the address it saw each rank
   connect from), listen port and node key.
3. Eager (the full mesh): rank ``i`` connects to each rank ``0 < j < i`` and accepts from each
   rank ``j > i``; the connection to rank 0 is kept as the ``(0, i)`` link. Lazy
   (``lazy=True``, connections on first use, :mod:`.lazy`): every rank closes its connection
   to rank 0 and keeps its listener; rank 0 keeps the job's. Rank 0 then did O(n) handshakes and
   no rank connects to any other until it sends to or receives from it.

Every connection starts with :mod:`.handshake`. Errors name the rank, address, port and the ranks
that never came: :class:`RendezvousError` for ports in use, peers that never came up or joined.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
import time

from ..checks import wait_limit
from ..errors import AuthenticationError, DistributedError, ProtocolError, RendezvousError
from .handshake import (
    ST_BAD,
    ST_OK,
    client_handshake,
    decode_info,
    encode_info,
    recv_exactly,
    send_status,
    server_handshake,
)

log = logging.getLogger("ferro_backend.tcp")

SOCKET_BUFFER = 4 << 20
#: seconds a connection may take to complete its handshake before it is dropped
HANDSHAKE_TIMEOUT = 10.0
_ACCEPT_POLL = 0.05
#: the most bytes one rank's row of the address table takes (host and node: at most 65535
#: bytes each on the wire, JSON-escaped to at most 6 bytes per byte; port and punctuation: 64)
_TABLE_ROW_MAX = 2 * 6 * 0xFFFF + 64


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


def listen(host: str, port: int, rank: int, world_size: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free one) for a rendezvous of
    ``world_size`` ranks; RendezvousError naming the rank, address and port if it cannot."""
    lsock = socket.socket(_family(host), socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    _tune(lsock)
    try:
        lsock.bind((host, port))
    except OSError as exc:
        lsock.close()
        raise RendezvousError(
            f"rank {rank}: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc
    lsock.listen(max(16, world_size))
    return lsock


def connect_to(host: str, port: int, deadline: float, rank: int, world: int, peer: int,
               listen_port: int, key: bytes, node: str = "", *, retry: bool = True
               ) -> socket.socket:
    """A connection to rank ``peer`` at ``host:port``, handshaken (auth, then this rank's info).
    ``retry``: a refused connection is tried again until ``deadline`` (the peer may not be up
    yet); without it, ConnectionRefusedError goes to the caller (the peer is gone)."""
    delay = 0.02
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RendezvousError(f"rank {rank}: rank {peer} did not come up at {host}:{port} "
                                  f"within the connect timeout")
        sock = socket.socket(_family(host), socket.SOCK_STREAM)
        _tune(sock)
        sock.settimeout(max(0.05, min(remaining, 5.0)))
        try:
            sock.connect((host, port))
        except OSError:
            sock.close()
            if not retry:
                raise
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
            continue
        sock.settimeout(wait_limit(max(0.05, deadline - time.monotonic())))
        info = encode_info(rank, world, "", listen_port, node)
        where = f"rank {rank} -> rank {peer} at {host}:{port}"
        try:
            client_handshake(sock, key, info, where)
        except TimeoutError as exc:
            sock.close()
            raise RendezvousError(f"rank {rank}: handshake with rank {peer} at "
                                  f"{host}:{port} timed out") from exc
        except DistributedError:
            sock.close()
            raise
        except OSError as exc:  # the peer hung up or reset mid-handshake
            sock.close()
            raise RendezvousError(f"rank {rank}: handshake with rank {peer} at {host}:{port} "
                                  f"failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        return sock


class Rendezvous:
    """One rank's side of the mesh set-up; :meth:`run` returns ``{peer: connected socket}``."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, key: bytes,
                 listener: socket.socket | None = None, *, node: str = "",
                 lazy: bool = False) -> None:
        self.rank, self.world = rank, world_size
        self.host, self.port, self.key = host, port, key
        self.node, self.lazy = node, lazy
        #: after :meth:`run`: every rank's ``(host, listen port)`` and node key (index = rank)
        self.table: list[tuple[str, int]] = []
        self.nodes: list[str] = []
        #: lazy: this rank's listener, left open for the connections made on first use
        self.kept_listener: socket.socket | None = None
        #: rank 0's listening socket when the caller bound it already (a launcher that picked a
        #: free port and told the other ranks, :mod:`.launchers`); taken over and closed here
        self.listener = listener
        #: where connections refused for a wrong job token came from (named if ranks are late)
        self.wrong_token: list[str] = []

    def run(self, deadline: float) -> dict[int, socket.socket]:
        socks: dict[int, socket.socket] = {}
        if self.listener is not None and self.rank != 0:
            self.listener.close()
            self.listener = None
        try:
            if self.rank == 0:
                self._as_root(socks, deadline)
            else:
                self._as_member(socks, deadline)
        except BaseException:
            for s in socks.values():
                s.close()
            raise
        return socks

    def _as_root(self, socks: dict[int, socket.socket], deadline: float) -> None:
        lsock = self.listener if self.listener is not None else self._listen(self.host, self.port)
        try:
            joined = self._accept(lsock, set(range(1, self.world)), deadline, tell_joined=True)
        except BaseException:
            lsock.close()
            raise
        if self.lazy:
            self.kept_listener = lsock
        else:
            lsock.close()
        rows = [[self.host, self.port, self.node]] + [
            [joined[r][1], joined[r][2], joined[r][3]] for r in range(1, self.world)]
        self._keep_table(rows)
        payload = json.dumps(rows).encode()
        for r, (sock, _, _, _) in joined.items():
            sock.sendall(struct.pack("<Q", len(payload)) + payload)
            if self.lazy:
                sock.close()
            else:
                socks[r] = sock

    def _keep_table(self, rows: list) -> None:
        self.table = [(str(h), int(p)) for h, p, _ in rows]
        self.nodes = [str(k) for _, _, k in rows]

    def _as_member(self, socks: dict[int, socket.socket], deadline: float) -> None:
        rank, world = self.rank, self.world
        # Listen first (on loopback for a loopback job, else on every interface); rank 0 tells
        # the others the address it saw this rank connect from.
        loopback = self.host.startswith("127.") or self.host in ("localhost", "::1")
        wildcard = "::" if _family(self.host) == socket.AF_INET6 else "0.0.0.0"
        lsock = self._listen(self.host if loopback else wildcard, 0)
        try:
            port = lsock.getsockname()[1]
            master = self._connect(self.host, self.port, deadline, 0, port)
            socks[0] = master
            master.settimeout(wait_limit(max(0.05, deadline - time.monotonic())))
            try:
                (n,) = struct.unpack("<Q", recv_exactly(master, 8))
                if n > world * _TABLE_ROW_MAX:
                    raise ValueError(f"an address table of {n} bytes for {world} ranks, at "
                                     f"most {world * _TABLE_ROW_MAX}")
                rows = json.loads(recv_exactly(master, n))
                if isinstance(rows, dict) and "error" in rows:  # rank 0 gave up (_tell_joined)
                    raise _RootGaveUp(str(rows["error"]))
                if len(rows) != world:
                    raise ValueError(f"a table of {len(rows)} ranks for a job of {world}")
                self._keep_table(rows)
            except _RootGaveUp as exc:
                raise RendezvousError(f"rank {rank}: rank 0 at {self.host}:{self.port} ended "
                                      f"the rendezvous: {exc}") from None
            except (OSError, ValueError, TypeError) as exc:
                raise RendezvousError(f"rank {rank}: no address table from rank 0 at "
                                      f"{self.host}:{self.port}: {exc}") from exc
            if self.lazy:
                socks.pop(0).close()
                self.kept_listener, lsock = lsock, None
                return
            for peer in range(1, rank):
                host, pport = self.table[peer]
                socks[peer] = self._connect(host, pport, deadline, peer, port)
            if rank < world - 1:
                joined = self._accept(lsock, set(range(rank + 1, world)), deadline)
                for r, (sock, _, _, _) in joined.items():
                    socks[r] = sock
        finally:
            if lsock is not None:
                lsock.close()

    def _listen(self, host: str, port: int) -> socket.socket:
        return listen(host, port, self.rank, self.world)

    def _connect(self, host: str, port: int, deadline: float, peer: int, listen_port: int
                 ) -> socket.socket:
        return connect_to(host, port, deadline, self.rank, self.world, peer, listen_port,
                          self.key, self.node)

    def _accept(self, lsock: socket.socket, expected: set[int], deadline: float, *,
                tell_joined: bool = False) -> dict[int, tuple[socket.socket, str, int, str]]:
        """Accept authenticated connections until every rank in ``expected`` has joined.

        Each connection's handshake runs in a thread of its own, so a stranger that connects
        and says nothing (or a hundred of them) cannot hold up the ranks behind it; the ranks'
        claims are checked here, one at a time. A process that knows the job's token but
        claims another world size, a rank outside this job or a rank that already joined is a
        misconfigured job, not a stranger: it is refused with the reason, and this rank raises
        RendezvousError at once rather than waiting for the deadline (``tell_joined``, rank 0:
        the ranks that joined already, waiting for the address table, get the reason instead).
        """
        joined: dict[int, tuple[socket.socket, str, int, str]] = {}
        host, port = lsock.getsockname()[:2]
        arrivals: queue.SimpleQueue = queue.SimpleQueue()
        lsock.settimeout(_ACCEPT_POLL)
        try:
            while len(joined) < len(expected):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(expected - joined.keys())
                    raise RendezvousError(
                        f"rank {self.rank} listening on {host}:{port}: ranks {missing} did not "
                        f"join within the connect timeout{self._wrong_token_note()}")
                try:
                    sock, peer_addr = lsock.accept()
                except TimeoutError:
                    pass
                else:
                    sock.settimeout(max(0.05, min(remaining, HANDSHAKE_TIMEOUT)))
                    threading.Thread(target=self._greet, args=(sock, peer_addr, arrivals),
                                     daemon=True, name=f"ferro-handshake-{self.rank}").start()
                while not arrivals.empty():
                    sock, peer_addr, info = arrivals.get()
                    problem = self._admit(sock, peer_addr, info, expected, joined)
                    if problem is not None:
                        message = (f"rank {self.rank} listening on {host}:{port}: {problem}; "
                                   "the job's ranks were not started alike")
                        if tell_joined:
                            self._tell_joined(joined, message)
                        raise RendezvousError(message)
        except BaseException:
            for s, _, _, _ in joined.values():
                s.close()
            raise
        return joined

    def _greet(self, sock: socket.socket, peer_addr, arrivals: queue.SimpleQueue) -> None:
        """A connection's handshake (in its own thread); a stranger is refused and dropped."""
        try:
            server_handshake(sock, self.key)
            arrivals.put((sock, peer_addr, decode_info(sock)))
        except (ProtocolError, AuthenticationError, OSError, struct.error) as exc:
            log.warning("rank %d: refused a connection from %s: %s", self.rank, peer_addr, exc)
            if isinstance(exc, AuthenticationError):
                self.wrong_token.append(_where(peer_addr))
            sock.close()

    def _wrong_token_note(self) -> str:
        """For the timeout's message: the connections refused for a wrong token (a rank
        started with another job's FERRO_TOKEN / token= never joins)."""
        refused = list(self.wrong_token)
        if not refused:
            return ""
        shown = ", ".join(dict.fromkeys(refused[:3]))
        more = f" and {len(refused) - 3} more" if len(refused) > 3 else ""
        return (f"; meanwhile {len(refused)} connection(s) were refused for a wrong job token "
                f"(from {shown}{more}): a rank started with another token (FERRO_TOKEN, token=)")

    def _admit(self, sock: socket.socket, peer_addr, info: tuple[int, int, str, int, str],
               expected: set[int], joined: dict) -> str | None:
        """Admit a rank's claim into ``joined``, or refuse it (telling the peer why, never
        raising); the reason a refused claim shows the job misconfigured, else None."""
        prank, pworld, phost, pport, pnode = info
        at = _where(peer_addr)
        problem = None
        if pworld != self.world:
            problem = (f"rank {prank} (from {at}) says WORLD_SIZE={pworld}, rank {self.rank} "
                       f"expects WORLD_SIZE={self.world}")
        elif prank in joined:
            problem = (f"two processes claim rank {prank} (from {_where(joined[prank][0])} "
                       f"and from {at})")
        elif prank not in expected:
            problem = (f"rank {prank} (from {at}) is not expected here (expected ranks "
                       f"{_ranks(expected)} of WORLD_SIZE={self.world})")
            if prank == self.rank:
                problem = (f"two processes claim rank {prank} (this one and the one from "
                           f"{at})")
        try:
            if problem:
                send_status(sock, ST_BAD, problem)
                raise ProtocolError(problem)
            send_status(sock, ST_OK)
        except (ProtocolError, OSError) as exc:
            log.warning("rank %d: refused a connection from %s: %s", self.rank, peer_addr, exc)
            sock.close()
            return problem
        joined[prank] = (sock, phost or peer_addr[0], pport, pnode)
        return None

    @staticmethod
    def _tell_joined(joined: dict, message: str) -> None:
        """Rank 0 gives up: send the ranks that joined ``{"error": message}`` where they wait
        for the address table (best effort: the sockets are closed right after)."""
        payload = json.dumps({"error": message}).encode()
        for sock, _, _, _ in joined.values():
            try:
                sock.settimeout(1.0)
                sock.sendall(struct.pack("<Q", len(payload)) + payload)
            except OSError:
                pass


class _RootGaveUp(Exception):
    """Rank 0 sent its reason in place of the address table."""


def _where(peer) -> str:
    """``host:port`` of a peer address or a connected socket, for messages."""
    if isinstance(peer, socket.socket):
        try:
            peer = peer.getpeername()
        except OSError:
            return "?"
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


def _ranks(ranks: set[int]) -> str:
    """``{1, 2, 3}`` -> ``"1..3"`` where contiguous (a big job's list stays short)."""
    s = sorted(ranks)
    if len(s) > 2 and s[-1] - s[0] == len(s) - 1:
        return f"{s[0]}..{s[-1]}"
    return str(s)


#: where free_port looks first: below Linux's default ephemeral range (32768-60999), so that no
#: outgoing connection of another test running at the same time takes the port before the job
#: that was given it binds it
QUIET_PORTS = (20000, 32000)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago: a random one outside the ephemeral
    range when one binds (parallel test sessions rarely pick the same), else any free port."""
    import random

    pick = random.SystemRandom()
    for _ in range(50):
        port = pick.randrange(*QUIET_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
