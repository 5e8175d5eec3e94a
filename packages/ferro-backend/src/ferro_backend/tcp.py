"""A multi-process backend over TCP: a full mesh of authenticated connections.

The parts, each in its own module: :mod:`.handshake` (protocol check and mutual HMAC auth keyed by
the job's ``token``, argument or ``FERRO_TOKEN``), :mod:`.rendezvous` (building the mesh from
``master_addr``), :mod:`.framing` (frames and the reader thread that drains each link into the
rank's :class:`~ferro_backend.mailbox.Mailbox`), :mod:`.teardown` (goodbyes, aborts, release).
This module puts them together behind the :class:`~ferro_backend.Backend` contract.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import numpy as np

from . import settings
from .base import (
    DEFAULT_TIMEOUT,
    MAX_TAG,
    Backend,
    FixedRanks,
    Request,
    as_recv_view,
    check_rank,
    check_world_size,
    timeout_from_env,
)
from .errors import CollectiveTimeoutError, RendezvousError
from .framing import K_DATA, Link, read_frames
from .mailbox import Mailbox
from .rendezvous import Rendezvous, parse_addr
from .rings import READY, TIME_UP, RingMesh, RingRecv
from .teardown import release, say_goodbye, send_abort

__all__ = ["TcpBackend", "parse_addr"]


class TcpBackend(FixedRanks, Backend):
    """One rank of a multi-process job over TCP (full mesh).

    Parameters
    ----------
    rank, world_size
        This process's rank and the number of processes.
    master_addr
        ``"host:port"`` where rank 0 listens for the rendezvous.
    timeout
        :attr:`Backend.timeout`: the default deadline, in seconds, of receives, barriers and
        collectives on this backend, and of the rendezvous.
    token
        Shared secret; every connection proves knowledge of it (HMAC challenge). Defaults to
        the ``FERRO_TOKEN`` environment variable; without one, connections are checked for the
        protocol magic and version only.
    connect_timeout
        Seconds the rendezvous may take (default: ``timeout``).
    listener
        Rank 0 only: a socket already bound and listening, taken over for the rendezvous
        instead of binding ``master_addr`` (how :func:`~ferro_backend.init_from_env` uses a
        free port it told the other ranks about through the launcher, without a race).

    Raises
    ------
    InvalidRankError, InvalidWorldSizeError
        Bad ``rank``/``world_size``.
    ValueError
        A timeout that is negative, NaN or not a number; a ``master_addr`` that is not
        ``host:port``.
    RendezvousError
        The port is in use, rank 0 never came up, or a rank never joined (the message names the
        address, the port and the ranks).
    AuthenticationError
        This process's token is not the job's.

    Notes
    -----
    For transports built on this mesh (``ShmBackend``), the protected interface is:
    ``_links[peer]`` (a :class:`~ferro_backend.framing.Link`: ``send_frame``, ``read_into``,
    byte counters), ``_box`` (this rank's mailbox), ``_checked_send_view``, ``_fail_if_down``,
    the hook :meth:`_on_frame` for frame kinds of their own, and :meth:`_teardown`.
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, *,
                 timeout: float = DEFAULT_TIMEOUT, token: str | bytes | None = None,
                 connect_timeout: float | None = None,
                 listener: socket.socket | None = None) -> None:
        check_world_size(world_size)
        check_rank(rank, world_size)
        self._rank = rank
        self._world = world_size
        self.timeout = timeout
        connect = self.resolve_timeout(connect_timeout, "TcpBackend: connect_timeout")
        if token is None:
            token = settings.TOKEN.get()
        key = token.encode() if isinstance(token, str) else (token or b"")
        self.master_addr = master_addr
        host, port = parse_addr(master_addr)
        self._box = Mailbox(rank, lambda: self.timeout)
        self._state_lock = threading.Lock()
        self._links: dict[int, Link] = {}
        self._readers: list[threading.Thread] = []
        self._closers: list = []
        #: multi-node jobs: the node/cross groups (:mod:`ferro_backend.hierarchy`), else None
        self.hierarchy = None
        if world_size == 1 and listener is not None:
            listener.close()
        if world_size > 1:
            socks = Rendezvous(rank, world_size, host, port, key, listener).run(
                time.monotonic() + connect)
            self._links = {peer: Link(rank, peer, sock) for peer, sock in socks.items()}
            for peer, link in self._links.items():
                t = threading.Thread(target=read_frames,
                                     args=(link, self._box, self._on_frame,
                                           self._may_wait_for_receive),
                                     daemon=True, name=f"ferro-tcp-{rank}<-{peer}")
                t.start()
                self._readers.append(t)

    @classmethod
    def from_env(cls, **kwargs: Any) -> TcpBackend:
        """Build from the torchrun variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        (and FERRO_TOKEN, FERRO_TIMEOUT when set); keyword arguments override."""
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
        rings = 0 if self._rings is None else self._rings.sent
        return sum(link.sent for link in self._links.values()) + rings

    @property
    def bytes_received(self) -> int:  # type: ignore[override]
        rings = 0 if self._rings is None else self._rings.received
        return sum(link.received for link in self._links.values()) + rings

    # ------------------------------------------------------------------ protected interface
    def _fail_if_down(self, op: str, peer: int) -> None:
        """Raise if the job aborted, this backend closed, or ``peer`` is gone."""
        self._box.check(op, peer)

    def _checked_send_view(self, data: Any, dst: int, tag: int) -> memoryview:
        """Validate a send (peer, tag, buffer, liveness); return the bytes to send."""
        view = self._send_view(data, dst, tag)
        self._fail_if_down("send", dst)
        return view

    def _may_wait_for_receive(self) -> bool:
        """Whether a reader thread may wait a moment for the receive of a large frame to be
        posted (saving a buffer and a copy): not while a send of this process is stuck on a
        full socket. The receive would be posted after that send, which may wait on a peer
        whose reader waits on us the same way (two ranks that both send, then receive): each
        would sit out the whole wait (16 MiB each way: 77 ms instead of about 15)."""
        return not any(link.lock.locked() for link in self._links.values())

    def _on_frame(self, link: Link, kind: int, tag: int, length: int) -> bool:
        """Handle a frame kind the base protocol does not know; False: unknown (subclasses
        extend the protocol here, reading the payload with ``link.read_into``)."""
        return False

    # ------------------------------------------------------------------ data path
    #: the same-host engine's point-to-point rings (:mod:`.rings`) to the peers that share
    #: this rank's segment: every peer of a ShmBackend, the node's ranks of a multi-node job
    #: (:mod:`.hierarchy`); None: every message travels the sockets
    _rings: RingMesh | None = None

    def send(self, data: Any, dst: int, *, tag: int = 0) -> None:
        rings, box = self._rings, self._box
        if (rings is not None and type(data) is np.ndarray and type(dst) is int
                and type(tag) is int and dst in rings.out and 0 <= tag <= MAX_TAG
                and data.nbytes <= rings.eager_max and data.flags.c_contiguous
                and box.aborted is None and not box.closed
                and dst not in box.closed_peers):  # a small array, checked at a glance
            rc = rings.send_eager(data, data.nbytes, dst, tag, time.monotonic() + self._timeout)
            if rc == READY:
                return
            if rc == TIME_UP:
                raise CollectiveTimeoutError(
                    f"send: rank {self._rank} -> {dst} (tag {tag}): {data.nbytes} bytes not "
                    f"taken by the peer within {self._timeout:g}s (its ring stayed full)")
        view = self._checked_send_view(data, dst, tag)
        if rings is not None and dst in rings.out:
            return rings.send(view, dst, tag)
        self._send_frames(view, dst, tag)

    def _send_frames(self, view: memoryview, dst: int, tag: int) -> None:
        """Send a validated message over ``dst``'s socket."""
        self._links[dst].send_frame(K_DATA, tag, view, time.monotonic() + self.timeout,
                                    lambda: self._fail_if_down("send", dst))

    def irecv(self, out: Any, src: int, *, tag: int = 0) -> Request:
        view = self._recv_view(out, src, tag)
        rings = self._rings
        if rings is not None and src in rings.inc:
            return RingRecv(rings, self._box.post(src, tag, view, check=False))
        return self._box.post(src, tag, view)

    def recv(self, out: Any, src: int, *, tag: int = 0, timeout: float | None = None) -> None:
        rings = self._rings
        if rings is None or type(src) is not int or src not in rings.inc:
            self.irecv(out, src, tag=tag).wait(self.resolve_timeout(timeout, "recv: timeout"))
            return
        if (type(out) is np.ndarray and type(tag) is int and 0 <= tag <= MAX_TAG
                and (timeout is None or type(timeout) is float and timeout >= 0)
                and out.flags.c_contiguous and out.flags.writeable):  # checked at a glance
            limit = self._timeout if timeout is None else timeout
            deadline = time.monotonic() + limit
            done = rings.recv_now(out, out.nbytes, src, tag, deadline)
            view = as_recv_view(out) if done is False else None
        else:
            view = self._recv_view(out, src, tag)
            limit = self.resolve_timeout(timeout, "recv: timeout")
            deadline = time.monotonic() + limit
            done = rings.recv_now(view, len(view), src, tag, deadline)
        if done is True:
            return
        req = self._box.post(src, tag, view, check=False) if done is False else done
        RingRecv(rings, req).wait_until(deadline, limit)

    # ------------------------------------------------------------------ teardown
    def link_transports(self) -> tuple[str, str]:
        # Every pair has its own TCP connection; on several nodes each node also maps its own
        # engine segment, on which the collectives' node stages and the node's point-to-point
        # messages run (ferro_backend.hierarchy)
        if self.hierarchy is not None:
            lay = self.hierarchy.node.engine.layout
            p2p = (f"point-to-point: {lay['ring_bytes'] >> 10} KiB rings" if self._rings
                   is not None else "TCP loopback for point-to-point")
            return (f"shared-memory engine (the collectives' node stages: "
                    f"{lay['slot_bytes'] >> 10} KiB slots; {p2p})", "TCP (the collectives' "
                    "cross-node stages: each local rank carries 1/L of the data)")
        return "TCP", "TCP"

    def abort(self, reason: str) -> None:
        """Tell every peer that this rank failed, then close. Peers' blocked calls raise
        :class:`PeerAbortedError` naming this rank and ``reason``."""
        if self._box.closed:
            return
        send_abort(self._links.values(), reason)
        self._box.abort(self._rank, reason)
        self._teardown(wait=0.0)

    def close(self) -> None:
        """Say goodbye to every peer and release the sockets. Idempotent."""
        if self._box.closed:
            return
        say_goodbye(self._links.values())
        self._teardown(wait=0.5)

    def _teardown(self, wait: float) -> None:
        """Mark this backend closed (once), then release links and readers."""
        with self._state_lock:
            if self._box.closed:
                return
            self._box.close()
        for closer in self._closers:  # e.g. a node's engine segment (ferro_backend.hierarchy)
            closer()
        release(self._links.values(), self._readers, wait)

    def __del__(self) -> None:
        try:
            if not self._box.closed:
                self._teardown(wait=0.0)
        except Exception:
            pass
