"""A multi-process backend over TCP: a full mesh of authenticated connections.

The parts, each in its own module: :mod:`.handshake` (protocol check and mutual HMAC auth keyed by
the job's ``token``, argument or ``FERRO_TOKEN``), :mod:`.rendezvous` (building the mesh from
``master_addr``), :mod:`.framing` (frames, and the reader thread per link of
``FERRO_TCP_READER=threads``), :mod:`.reactor` (the default: one epoll receive loop per process
that drains every link into the rank's :class:`~ferro_backend.mailbox.Mailbox`), :mod:`.teardown`
(goodbyes, aborts, release).
This module puts them together behind the :class:`~ferro_backend.Backend` contract.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import settings
from ..base import DEFAULT_TIMEOUT, Backend, FixedRanks, Request
from ..checks import as_recv_view, check_rank, check_tag, check_world_size, timeout_from_env
from ..errors import DistributedError, PeerClosedError, RendezvousError
from ..mailbox import Mailbox
from ..posted import PumpedRecv
from ..subgroup_aborts import SubgroupAborts
from .compose import Composable
from .framing import K_DATA, Link, read_frames
from .lazy import Connector
from .reactor import Reactor
from .rendezvous import Rendezvous, parse_addr
from .route import Route
from .teardown import CONTROL_FRAME_TIMEOUT, release, say_goodbye, send_abort

__all__ = ["LAZY_ABOVE", "TcpBackend", "parse_addr"]

log = logging.getLogger("ferro_backend.tcp")

#: ``connect="auto"`` (the default) makes connections on first use in jobs of more ranks than
#: this: the full mesh's n(n-1)/2 handshakes and n - 1 reader threads per rank cost seconds
#: beyond it (128 ranks on 2 cores: 9.1 s to form the job), and its eager failure detection
#: matters less than getting the job up
LAZY_ABOVE = 32
#: seconds an aborting rank of a lazy mesh spends connecting to the peers it never talked to
ABORT_REACH = 2.0


class TcpBackend(FixedRanks, Composable, SubgroupAborts, Backend):
    """One rank of a multi-process job over TCP (full mesh).

    Parameters
    ----------
    rank, world_size : int
        This process's rank and the number of processes.
    master_addr : str
        ``"host:port"`` where rank 0 listens for the rendezvous.
    timeout : float, default 60.0
        :attr:`Backend.timeout`: the default deadline, in seconds, of receives, barriers and
        collectives on this backend, and of the rendezvous.
    token : str or bytes, optional
        Shared secret; every connection proves knowledge of it (HMAC challenge). Defaults to
        the ``FERRO_TOKEN`` environment variable; without one, connections are checked for the
        protocol magic and version only.
    connect_timeout : float, optional
        Seconds the rendezvous may take (default: ``timeout``); an engine segment's setup
        (a :class:`ShmBackend`'s, a node's) may take as long again, or ``timeout`` if longer.
    listener : socket.socket, optional
        Rank 0 only: a socket already bound and listening, taken over for the rendezvous
        instead of binding ``master_addr`` (how :func:`~ferro_backend.init_from_env` uses a
        free port it told the other ranks about through the launcher, without a race).
    node : str, optional
        This rank's node key (``ferro_backend.joining.meet.node_key``); rank 0's table carries
        every rank's, and :attr:`~ferro_backend.TcpBackend.nodes` holds them when all gave one.
    connect : {"auto", "eager", "lazy"}, optional
        ``"eager"`` (every pair connected at start: the full mesh), ``"lazy"`` (a pair connects
        when one of its ranks first sends to or receives from the other: ``mesh/lazy.py``) or
        ``"auto"`` (lazy beyond ``mesh.tcp.LAZY_ABOVE`` ranks); default ``FERRO_TCP_CONNECT``.

    Raises
    ------
    InvalidRankError, InvalidWorldSizeError
        Bad ``rank``/``world_size``.
    ValueError
        A timeout that is negative, NaN or not a number; a ``master_addr`` that is not
        ``host:port``.
    TypeError
        A ``token`` that is neither a str nor bytes (named at once, before any connection).
    RendezvousError
        The port is in use, rank 0 never came up, or a rank never joined (the message names the
        address, the port and the ranks).
    AuthenticationError
        This process's token is not the job's.

    Notes
    -----
    Transports built on this mesh compose it through public methods: :meth:`install_route`
    (messages to some peers take another way: the same-host engine's rings),
    :attr:`mailbox`, :meth:`on_failure`, :meth:`on_close` and :meth:`peer_failure`.
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, *,
                 timeout: float = DEFAULT_TIMEOUT, token: str | bytes | None = None,
                 connect_timeout: float | None = None,
                 listener: socket.socket | None = None, node: str | None = None,
                 connect: str | None = None) -> None:
        check_world_size(world_size)
        check_rank(rank, world_size)
        self._rank = rank
        self._world = world_size
        self.timeout = timeout
        setup = self.resolve_timeout(connect_timeout, "TcpBackend: connect_timeout")
        #: seconds the job's setup steps may take (the rendezvous; a ShmBackend's engine)
        self.connect_timeout = setup
        mode = settings.TCP_CONNECT.parse(connect) if connect is not None else \
            settings.TCP_CONNECT.get()
        self.lazy = world_size > 1 and (mode == "lazy" or (mode == "auto" and
                                                           world_size > LAZY_ABOVE))
        if token is None:
            token = settings.TOKEN.get()
        elif not isinstance(token, str | bytes | bytearray):  # (else a handshake thread dies)
            raise TypeError(f"{type(self).__name__}: token must be a str or bytes (or None), got "
                            f"{type(token).__name__}")
        key = token.encode() if isinstance(token, str) else bytes(token or b"")
        self.master_addr = master_addr
        host, port = parse_addr(master_addr)
        self._box = Mailbox(rank, lambda: self.timeout, world_size)
        self._state_lock = threading.Lock()
        self._links: dict[int, Link] = {}
        self._readers: list[threading.Thread] = []
        self._closers: list[Callable[[], None]] = []
        #: peer -> the route its messages take instead of the sockets (install_route)
        self._routes: dict[int, Route] = {}
        self._route_list: list[Route] = []
        self._connector: Connector | None = None
        #: the receive loop (FERRO_TCP_READER=loop), else a reader thread per link
        self._reactor: Reactor | None = None
        if world_size == 1 and listener is not None:
            listener.close()
        if world_size == 1:
            return
        try:
            if settings.TCP_READER.get() == "loop":
                self._reactor = Reactor(rank, self._box, self._may_wait_for_receive)
            meet = Rendezvous(rank, world_size, host, port, key, listener, node=node or "",
                              lazy=self.lazy)
            socks = meet.run(time.monotonic() + setup)
            if node is not None and all(meet.nodes):
                self.nodes = tuple(meet.nodes)
            for peer, sock in socks.items():
                self._add_link(peer, sock)
            if self.lazy:
                self._connector = Connector(rank, world_size, key, meet.kept_listener,
                                            meet.table, node or "", self._add_link,
                                            self._links.__contains__)
        except BaseException:
            # a job that did not form: its receive loop (a thread, an epoll fd and a pipe) and
            # any link made so far go now, not with the garbage collector (never, for the loop)
            try:
                self._teardown(wait=0.0)
            except Exception as exc:
                log.warning("TcpBackend: releasing a failed setup also failed: %r", exc)
            raise

    def _add_link(self, peer: int, sock: socket.socket) -> None:
        """``sock`` (handshaken) becomes the link to ``peer``, drained by the receive loop or
        by a reader thread of its own."""
        link = Link(self._rank, peer, sock)
        self._links[peer] = link
        if self._reactor is not None:
            self._reactor.add(link)
            return
        t = threading.Thread(target=read_frames, args=(link, self._box,
                                                       self._may_wait_for_receive),
                             daemon=True, name=f"ferro-tcp-{self._rank}<-{peer}")
        t.start()
        self._readers.append(t)

    def _link(self, peer: int, op: str) -> Link:
        """The link to ``peer``, connected now if this is the pair's first use (lazy)."""
        link = self._links.get(peer)
        if link is not None:
            return link
        if self._connector is None:
            raise KeyError(peer)
        self._fail_if_down(op, peer)
        try:
            self._connector.connect(peer, time.monotonic() + self.timeout)
        except PeerClosedError as exc:
            self._box.peer_closed(peer, str(exc))
            raise
        return self._links[peer]

    @property
    def connections(self) -> int:
        """The TCP connections this rank holds to its peers (lazy: the pairs used so far)."""
        return len(self._links)

    @classmethod
    def from_env(cls, **kwargs: Any) -> TcpBackend:
        """Build from the torchrun variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        (and FERRO_TOKEN, FERRO_TIMEOUT when set); keyword arguments override.

        Parameters
        ----------
        **kwargs
            The constructor's arguments (``rank``, ``world_size``, ``master_addr`` included).

        Returns
        -------
        TcpBackend
            This rank's backend, the job formed.

        Raises
        ------
        RendezvousError
            A variable is unset (names them), or the job does not form.
        """
        env = os.environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing and not {"rank", "world_size", "master_addr"} <= kwargs.keys():
            raise RendezvousError(f"{cls.__name__}.from_env: environment variables {missing} are "
                                  "unset (run under ferrorun or torchrun)")
        rank = kwargs.pop("rank", None)
        world = kwargs.pop("world_size", None)
        addr = kwargs.pop("master_addr", None)
        env_timeout = timeout_from_env()
        if env_timeout is not None:
            kwargs.setdefault("timeout", env_timeout)
        return cls(int(env["RANK"]) if rank is None else rank,
                   int(env["WORLD_SIZE"]) if world is None else world,
                   f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" if addr is None else addr,
                   **kwargs)

    @property
    def bytes_sent(self) -> int:  # type: ignore[override]
        """Payload bytes sent over the sockets and through the routes."""
        return sum(link.sent for link in list(self._links.values())) + sum(
            route.bytes_sent for route in self._route_list)

    @property
    def bytes_received(self) -> int:  # type: ignore[override]
        """Payload bytes received over the sockets and through the routes."""
        return sum(link.received for link in list(self._links.values())) + sum(
            route.bytes_received for route in self._route_list)

    def peer_failure(self, op: str, peer: int) -> BaseException | None:
        return self._box.failure(op, peer)

    def _fail_if_down(self, op: str, peer: int) -> None:
        """Raise if the job aborted, this backend closed, or ``peer`` is gone."""
        self._box.check(op, peer)

    def _may_wait_for_receive(self) -> bool:
        """Whether a reader thread may wait a moment for the receive of a large frame to be
        posted (saving a buffer and a copy): not while a send of this process is stuck on a
        full socket. The receive would be posted after that send, which may wait on a peer
        whose reader waits on us the same way (two ranks that both send, then receive): each
        would sit out the whole wait (benchmarks/README.md, "Measurements behind the
        defaults")."""
        return not any(link.lock.locked() for link in list(self._links.values()))

    def _send_notice(self, notice: bytes, dst: int, tag: int) -> None:
        # on the socket, whatever the pair's route: its reader delivers it unasked, where a
        # ring's messages reach the mailbox only as a receive drains them (behind the data a
        # late member would take first); never on a forked child's copies of the sockets
        if self._box.forked is not None:
            self._box.check("abort_group", dst)
        self._link(dst, "abort_group").send_frame(K_DATA, tag, memoryview(notice),
                                                  time.monotonic() + CONTROL_FRAME_TIMEOUT)

    # ------------------------------------------------------------------ data path
    def send(self, data: Any, dst: int, *, tag: int = 0) -> None:
        route = self._routes.get(dst) if type(dst) is int else None
        if route is not None:
            return route.send(data, dst, tag)
        view = self._send_view(data, dst, tag)
        self._fail_if_down("send", dst)
        # a send that must wait for room in the socket: the receive loop reads meanwhile
        self._link(dst, "send").send_frame(K_DATA, tag, view, time.monotonic() + self.timeout,
                                           lambda: self._fail_if_down("send", dst),
                                           None if self._reactor is None else self._reactor.resume)

    def irecv(self, out: Any, src: int, *, tag: int = 0) -> Request:
        view = self._recv_view(out, src, tag)
        route = self._routes.get(src)
        if route is not None:
            return route.irecv(view, src, tag)
        if self._connector is not None and src not in self._links:
            self._link(src, "recv")  # a receive is a first use too: the peer's death shows
        return self._box.post(src, tag, view)

    def recv(self, out: Any, src: int, *, tag: int = 0, timeout: float | None = None) -> None:
        route = self._routes.get(src) if type(src) is int else None
        if route is not None:
            return route.recv(out, src, tag, timeout)
        self.irecv(out, src, tag=tag).wait(self.resolve_timeout(timeout, "recv: timeout"))

    def irecv_any(self, out: Any, *, tag: int = 0) -> Request:
        check_tag(tag)
        view = as_recv_view(out)
        if self._connector is not None:  # a use of every socket pair: their failures show
            for peer in range(self._world):
                if peer != self._rank and peer not in self._routes and peer not in self._links:
                    self._link(peer, "recv")
        routes = {id(r): r for r in self._routes.values()}
        for route in routes.values():  # what sits in a ring is queued before the post looks
            route.pump()
        req = self._box.post_any(tag, view)
        if req.is_completed() or not routes:
            return req  # the sockets' receive loop delivers by itself
        return PumpedRecv(req, [r.pump for r in routes.values()])

    # ------------------------------------------------------------------ teardown
    def link_transports(self) -> tuple[str, str]:
        # Every pair has its own TCP connection; on several nodes each node also maps its own
        # engine, on which the collectives' node stages and the node's point-to-point
        # messages run (ferro_backend.hierarchy describes them)
        if self.hierarchy is not None:
            return self.hierarchy.link_transports()
        return "TCP", "TCP"

    def abort(self, reason: str) -> None:
        """Tell every peer that this rank failed, then close. Peers' blocked calls raise
        :class:`PeerAbortedError` naming this rank and ``reason``.

        Parameters
        ----------
        reason : str
            Why, in words: the peers' errors carry it.
        """
        if self._box.closed:
            return
        self.finish_publishing()  # (a refused call's reason goes out before the notice)
        if self._connector is not None:
            self._reach_all(ABORT_REACH)
        send_abort(list(self._links.values()), reason)
        self._box.abort(self._rank, reason)
        self._teardown(wait=0.0)

    def close(self) -> None:
        """Say goodbye to every peer and release the sockets. Idempotent. In a forked child of
        the process that made it, only the child's copies of the sockets are closed (no
        goodbye, no shutdown: the parent's job goes on)."""
        if self._box.forked is not None:
            for link in list(self._links.values()):
                link.sock.close()
            return
        if self._box.closed:
            return
        self.finish_publishing()  # (a refused call's reason goes out before the goodbye)
        if self._connector is not None:
            self._connector.close()
        say_goodbye(list(self._links.values()))
        self._teardown(wait=0.5)

    def _teardown(self, wait: float) -> None:
        """Mark this backend closed (once), then release links and readers: every step runs
        even when one raises (a closer of the user's, a trace that cannot be written); the
        first error is raised after all ran."""
        with self._state_lock:
            if self._box.closed:
                return
            self._box.close()
        steps: list[Callable[[], object]] = [route.close for route in self._route_list]
        steps += self._closers  # e.g. an engine's segment (ShmBackend, hierarchy)
        if self._connector is not None:
            steps.append(self._connector.close)
        if self._reactor is not None:
            reactor = self._reactor
            steps.append(lambda: reactor.finish(wait))
        steps.append(lambda: release(list(self._links.values()), self._readers, wait))
        first: BaseException | None = None
        for step in steps:
            try:
                step()
            except Exception as exc:
                if first is None:
                    first = exc
                else:
                    log.warning("TcpBackend close: %s also failed: %r", step, exc)
        if first is not None:
            raise first

    def _reach_all(self, seconds: float) -> None:
        """Lazy mesh, before an abort: connect to the peers not connected yet, for at most
        ``seconds`` in all, so the abort reaches every rank that is still there."""
        end = time.monotonic() + seconds
        for peer in range(self._world):
            if peer == self._rank or peer in self._links or peer in self._routes:
                continue
            if time.monotonic() >= end:
                break
            try:
                self._connector.connect(peer, min(end, time.monotonic() + 1.0))
            except (DistributedError, OSError):
                pass

    def __del__(self) -> None:
        try:
            if not self._box.closed:
                self._teardown(wait=0.0)
        except Exception:
            pass
