"""The same-host engine of a group of ranks: one shared segment, its collective slots and rings.

:class:`Engine` is made by :meth:`Engine.join`, collectively over a backend whose ranks share a
host. Rank 0 creates the segment as an anonymous ``memfd`` and hands it to the other ranks as a
file descriptor over a Unix socket (``SCM_RIGHTS``). The socket lives in Linux's abstract
namespace under a random 128-bit name that rank 0 sends only over the job's authenticated
links, and rank 0 checks each connecting process's uid (``SO_PEERCRED``) and claimed rank.
Nothing ever has a name in the file system or ``/dev/shm``: the memory is freed when the last
rank unmaps it or dies, even by SIGKILL.

The segment's layout is declared once, in C (``_layout.h``); this module reads it from the
compiled ``_segment.layout``. What the engine offers its users (ferro-collective's collectives,
:mod:`.rings`' point-to-point messages):

* :attr:`Engine.comm`: the door's communicator (``_comm.Comm``): the collectives C clients
  call too (``ferro/engine.h``) and the order of calls; :meth:`Engine.capsule` hands it to a
  C client; :attr:`Engine.steps`: the steps one by one for ferro's Python (``_steps.Steps``),
  with :meth:`slot_data`;
* :meth:`Engine.ring` / :meth:`Engine.watch`: the point-to-point rings;
* :meth:`Engine.read` / :meth:`Engine.write`: single copies from and to a peer's memory;
* :meth:`Engine.mark_failed`: a peer died, closed or aborted: every wait gives up now;
* :attr:`Engine.bytes_sent` / :attr:`Engine.bytes_received`, :attr:`Engine.client` (the state
  of the layer that runs collectives on this engine, kept with it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hmac
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import settings
from ..checks import wait_limit
from ..errors import CollectiveTimeoutError, PeerClosedError, RendezvousError
from ..mesh.handshake import recv_exactly
from . import _comm, _ring, _segment, _steps, _watch, binding
from . import link as _link

if TYPE_CHECKING:
    from ..base import Backend

#: the tag of the set-up messages (in ferro's own tag range, below the collectives' base)
SETUP_TAG = (1 << 32) - 3
_NAME_PREFIX = b"\0ferro-engine-"
_NAME_BYTES = len(_NAME_PREFIX) + 32
_SECRET_BYTES = 32
#: the spin of a wait while every rank has a core of its own (none when they outnumber them)
SPIN = 4000


def default_ring_bytes(nranks: int) -> int:
    """Bytes of each point-to-point ring: ``FERRO_SHM_RING_BYTES``, else 256 KiB up to 8 ranks,
    then less (a power of two, at least 4 KiB) so the n*n rings stay within 16 MiB. (A ring's
    pages are only touched once its pair streams a message that large.)"""
    value = settings.SHM_RING_BYTES.get()
    if value is not None:
        return value
    size = 256 << 10
    while size > 4096 and nranks * nranks * size > (16 << 20):
        size >>= 1
    return size


#: plain copies into the segment this many times slower than between private buffers make
#: the engine stream its large calls too (``_steps.h``: ferro_slots_put)
SLOW_COPY = 12.0


def oversubscribed(nranks: int) -> bool:
    """Whether the ranks on this host (an engine's ``nranks``, or all of the emulated nodes'
    sharing it: ``binding.host_ranks``) outnumber its cores (then waits yield instead of
    spinning)."""
    return binding.host_ranks(nranks) > (os.cpu_count() or 1)


#: while the ranks outnumber the cores, allreduces below this many bytes divided by the ranks
#: run in one step, unsplit (see :func:`split_bytes`)
OVERSUBSCRIBED_SPLIT_TOTAL = 512 << 10


def split_bytes(nranks: int) -> int:
    """The allreduce split threshold rank 0 writes for its job: ``FERRO_SHM_SPLIT_BYTES`` when
    it is set; else its default (32 KiB), or, while the ranks outnumber the cores, 512 KiB / n
    when that is more. Split, each rank folds a part in a pipeline of chunks whose every wait
    may need a rank the scheduler has not run yet; unsplit, every rank folds every slot in one
    step (n times the work, one meeting). 4 ranks on 2 cores here (medians, us): 64 KiB 14-15
    unsplit against 18-20 split, 128 KiB level (24-26 / 22-24), 256 KiB 47-49 / 38-40; 3 ranks
    12-13 / 17 at 64 KiB, level at 128 KiB; 8 ranks split wins from 64 KiB (49-62 / 53-80)."""
    setting = settings.SHM_SPLIT_BYTES
    value = setting.get()
    if setting.is_set() or not oversubscribed(nranks):
        return value
    return max(value, OVERSUBSCRIBED_SPLIT_TOTAL // nranks)


class Engine:
    """This rank's mapping of a group's segment; made with :meth:`join` (collective)."""

    def __init__(self, rank: int, nranks: int, fd: int, size: int, slot_bytes: int,
                 ring_bytes: int, timeout: float) -> None:
        self.rank, self.nranks = rank, nranks
        self.slot_bytes, self.ring_bytes = slot_bytes, ring_bytes
        #: the segment's layout, from its C declaration (offsets and strides in bytes)
        self.layout = _segment.layout(nranks, slot_bytes, ring_bytes)
        busy = not oversubscribed(nranks)
        #: this rank's communicator (the door, ``ferro/engine.h``): it maps the segment (with
        #: every page populated up to 64 MiB: a page's first touch would otherwise fall inside
        #: a collective) and runs the collectives; ferro-collective drives it
        self.comm = _comm.Comm(fd, size, nranks, rank, slot_bytes, ring_bytes,
                               SPIN if busy else 0, 0 if busy else settings.SHM_YIELDS.get(),
                               timeout)
        #: this rank's steps one by one, for the collectives only ferro's Python runs
        self.steps = _steps.Steps(self.comm)
        self._bytes: np.ndarray | None = np.frombuffer(self.comm, dtype=np.uint8)
        self.address = self._bytes.ctypes.data
        self._size = size
        self._map: _segment.SegmentMap | None = _segment.SegmentMap(
            self._bytes, nranks, rank, slot_bytes, ring_bytes, self.comm.failed_address)
        self._ring_policy = (SPIN, 0) if busy else (0, settings.SHM_RING_YIELDS.get())
        lay = self.layout
        self._data = [[self._bytes[a + lay["head_bytes"]:a + lay["head_bytes"] + slot_bytes]
                       for a in (base, base + lay["parity_stride"])]
                      for base in (lay["slot_off"] + r * lay["slot_stride"] for r in range(nranks))]
        #: every rank's pid, and whether every rank may read every other's memory (CMA)
        self.pids: list[int] = []
        self.cma_ok = False
        self._cma_sent = self._cma_received = self._filled = 0
        #: the state of the layer that runs collectives on this engine (ferro-collective's)
        self.client: Any = None
        #: the thread ``binding.bind`` bound at the join, and the cores it had before
        self._bound: tuple[int | None, frozenset[int] | None] = (None, None)
        self._link: _link.Link | None = None

    # ------------------------------------------------------------------ what users call
    def slot_data(self, rank: int, step: int) -> np.ndarray:
        """``rank``'s slot data (bytes) of ``step``: the next step's, for this rank to fill
        before :meth:`SlotEngine.exchange`, or a finished step's, to read."""
        self._view()  # (closed: raises PeerClosedError)
        return self._data[rank][step & 1]

    def ring(self, src: int, dst: int) -> _ring.Ring:
        """The ring from ``src`` to ``dst`` (segment ranks), with this engine's wait policy."""
        return _ring.Ring(self._view(), self.nranks, self.slot_bytes, self.ring_bytes, src, dst,
                          self.comm.failed_address, *self._ring_policy)

    def watch(self, peers: list[int], stop_word: np.ndarray) -> _watch.Watch:
        """The backstop of this rank's incoming rings from ``peers`` (see ``_watch.pyx``)."""
        return _watch.Watch(self._view(), self.nranks, self.slot_bytes, self.ring_bytes,
                            self.rank, peers, stop_word)

    def _view(self) -> np.ndarray:
        if self._bytes is None:
            raise PeerClosedError(f"rank {self.rank}: the engine is closed", peer=self.rank)
        return self._bytes

    def read(self, rank: int, address: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``address`` in ``rank``'s memory into ``out``; a peer
        that is gone raises PeerClosedError naming it."""
        try:
            _segment.cma_read(self.pids[rank], address, out.reshape(-1).view(np.uint8))
        except OSError as exc:
            raise PeerClosedError(f"rank {self.rank}: cannot read rank {rank}'s memory ({exc})",
                                  peer=rank) from exc
        self._cma_received += out.nbytes

    def write(self, rank: int, address: int, data: np.ndarray) -> None:
        """Copy ``data`` to ``address`` in ``rank``'s memory (errors as :meth:`read`)."""
        try:
            _segment.cma_write(self.pids[rank], address, data.reshape(-1).view(np.uint8))
        except OSError as exc:
            raise PeerClosedError(f"rank {self.rank}: cannot write to rank {rank}'s memory "
                                  f"({exc})", peer=rank) from exc
        self._cma_sent += data.nbytes

    def count_filled(self, nbytes: int) -> None:
        """Count ``nbytes`` a user wrote into its slot itself (they left this rank)."""
        self._filled += nbytes

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank wrote into the segment or into peers' memory."""
        return self.comm.sent + self._cma_sent + self._filled

    @property
    def bytes_received(self) -> int:
        """Payload bytes this rank read from peers' memory."""
        return self._cma_received

    @property
    def failed(self) -> bool:
        return self.comm.failed

    def mark_failed(self, reason: str = "") -> None:
        """A peer died, closed or aborted (``reason``, if known), or this rank closed: every
        wait on the segment gives up now, and the door's calls say why."""
        self.comm.mark_failed(reason)

    def capsule(self) -> Any:
        """This rank's communicator for a C or C++ client: a capsule named
        ``ferro_backend.engine.comm`` (``ferro/engine.h``), holding a reference of its own."""
        return self.comm.capsule()

    def bound_cores(self) -> frozenset[int] | None:
        """The cores this rank runs on where the join bound the calling thread to a core of its
        own (``FERRO_SHM_BIND``): a client running engine calls on threads of its own (XLA's,
        say) gives them these too, since the engine's waits spin. None where the join bound
        nothing or bound another thread."""
        if self._bound[1] is None or self._bound[0] != threading.get_ident():
            return None
        return frozenset(os.sched_getaffinity(0))

    @property
    def link(self) -> _link.Link | None:
        """Where the ranks' cores stand: the segment's latest link probe (:mod:`.link`), as the
        job formed, on request (:meth:`probe_link`) or the door's own re-probe
        (``FERRO_SHM_REPROBE``); None where none ran (one rank, or more ranks than cores: the
        probe spins)."""
        if self._map is None:  # closed: the segment is gone
            return self._link
        probes, rtt, gbps, at = self._map.link_state()
        if probes and (self._link is None or self._link.probe != probes):
            self._link = _link.Link(rtt, gbps, at, probes)
        return self._link

    def probe_link(self, timeout: float | None = None) -> _link.Link | None:
        """Probe the link between the ranks' cores again (collective: every rank calls it, in
        the same order among its collectives); the new :attr:`link`, or None where the job
        cannot probe (one rank, or more ranks than cores).

        Raises CollectiveTimeoutError (a rank did not take part in ``timeout`` seconds:
        default the engine's) or PeerClosedError, as a collective would."""
        if self.nranks < 2 or oversubscribed(self.nranks):
            return None
        t = self.comm.timeout if timeout is None else timeout
        ticket = self.comm.reserve()
        try:
            rc = self.comm.begin(ticket, t, "probe_link")
            if rc == _comm.TIMEOUT:
                raise CollectiveTimeoutError(_comm.last_error())
            if rc != _comm.OK:
                raise PeerClosedError(_comm.last_error(), peer=self.rank)
            try:
                _link.probe(self, t)
            except TimeoutError as exc:
                raise CollectiveTimeoutError(str(exc)) from None
            except ConnectionError as exc:
                raise PeerClosedError(str(exc), peer=self.rank) from None
        finally:
            self.comm.end(ticket)
        return self.link

    def close(self) -> None:
        """Close the communicator (every later call: closed) and let the segment go: its pages
        are released as soon as no view of them is left (at once, unless a ring or an array of
        the caller's still holds one), even while this engine or its communicator is still
        referenced (by a closed backend, a C client)."""
        self.comm.close()
        if self._bound[0] == threading.get_ident():  # the thread it bound: its cores back
            binding.unbind(self._bound[1])
        views, self._bytes, self._data, self._map = self._bytes, None, [], None
        self.client = None  # (the collectives' state holds slot views: a call in flight keeps it)
        if views is not None:
            # (the communicator, an argument, outlives the finalizer: the range stays its own)
            release = weakref.finalize(views, _release_pages, self.comm, self.address,
                                       self._size)
            release.atexit = False  # (at exit the process's pages go anyway, threads or not)
        del views

    # ------------------------------------------------------------------ set-up
    @classmethod
    def join(cls, backend: Backend, slot_bytes: int | None = None,
             timeout: float | None = None) -> Engine:
        """Make (rank 0) or receive (others) the group's segment; every rank of ``backend``
        calls it. ``slot_bytes``: default ``FERRO_SHM_SLOT_BYTES``.

        Raises RendezvousError naming the rank and what failed.
        """
        rank, n = backend.rank, backend.world_size
        slot_bytes = settings.SHM_SLOT_BYTES.get() if slot_bytes is None else slot_bytes
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) \
                or not 64 <= slot_bytes <= settings.ENGINE_BYTES_MAX:
            # (beyond it the segment's size overflows: a segment too small, written past)
            raise ValueError(f"Engine.join: slot_bytes {slot_bytes!r}, expected an int from 64 "
                             f"to {settings.ENGINE_BYTES_MAX} (1 GiB)")
        ring_bytes = default_ring_bytes(n)
        size = _segment.layout(n, slot_bytes, ring_bytes)["size"]
        deadline = time.monotonic() + (backend.timeout if timeout is None else timeout)
        _segment.allow_peers_to_read()
        if rank == 0:
            fd = os.memfd_create("ferro-engine", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                _serve_fd(backend, fd, deadline)
                engine = cls(rank, n, fd, size, slot_bytes, ring_bytes, backend.timeout)
            finally:
                os.close(fd)
        else:
            fd = _fetch_fd(backend, deadline)
            try:
                engine = cls(rank, n, fd, size, slot_bytes, ring_bytes, backend.timeout)
            finally:
                os.close(fd)
        if rank == 0:
            engine._map.write_head(split_bytes(n))
        # every rank's pid and a probe word, for the cross-memory-read check below
        probe = np.array([0xC0FFEE00 + rank], dtype=np.uint64)
        engine._map.set_identity(os.getpid(), probe.ctypes.data)
        left = lambda: max(0.05, deadline - time.monotonic())
        backend.barrier(timeout=left())  # every rank mapped it
        if engine._map.head() != engine._map.expected_head():
            raise RendezvousError(
                f"rank {rank}: the engine segment is not this job's (magic, version, ranks, "
                f"slot and ring bytes {engine._map.head()}, expected "
                f"{engine._map.expected_head()}: is FERRO_SHM_RING_BYTES the same on every rank?)")
        engine.pids = [engine._map.identity(r)[0] for r in range(n)]
        engine.steps.split_bytes = engine._map.split_bytes()  # rank 0's: the same everywhere
        engine.steps.set_put(settings.SHM_STREAM_BYTES.get(), SLOW_COPY)
        mine = all(engine._can_read(r) for r in range(n) if r != rank)
        # every rank's verdict through rank 0 (which already talks to every rank), so a lazy
        # mesh opens no pair for it: a star, not all pairs
        verdict = bytearray([mine])
        if rank == 0:
            got = bytearray(1)
            for peer in range(1, n):
                backend.recv(got, peer, tag=SETUP_TAG, timeout=left())
                verdict[0] &= got[0]
            for peer in range(1, n):
                backend.send(bytes(verdict), peer, tag=SETUP_TAG)
        else:
            backend.send(bytes(verdict), 0, tag=SETUP_TAG)
            backend.recv(verdict, 0, tag=SETUP_TAG, timeout=left())
        engine.cma_ok = bool(verdict[0]) and settings.SHM_CMA.get() != "never"
        backend.barrier(timeout=left())  # probes read
        engine._bound = (threading.get_ident(), binding.bind(rank, n))
        if n > 1 and not oversubscribed(n):
            try:
                _link.probe(engine, left())
            except (TimeoutError, ConnectionError) as exc:
                raise RendezvousError(f"rank {rank}: {exc}") from None
            if rank == 0:  # (rank 0 asks for the re-probes; the others follow)
                engine.comm.reprobe_seconds = settings.SHM_REPROBE.get()
        return engine

    def _can_read(self, peer: int) -> bool:
        """True if this process may read ``peer``'s memory (cross-memory attach)."""
        pid, addr = self._map.identity(peer)
        out = np.zeros(1, dtype=np.uint64)
        try:
            _segment.cma_read(pid, addr, out.view(np.uint8))
        except OSError:
            return False
        return int(out[0]) == 0xC0FFEE00 + peer


log = logging.getLogger("ferro_backend.engine")
_libc: Any = None


def _release_pages(comm: _comm.Comm, address: int, size: int) -> None:
    """A closed engine's segment, no view of it left: zero pages of this process's own take
    its place, at the same address (``MAP_FIXED``), so the shared pages (and the memfd, once
    every rank's are gone) are freed now, not when the communicator ``comm`` goes, while a
    pointer into the range (a call still ending, a C client's) stays valid. The communicator
    unmaps the range when it goes, as before."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
    flags = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
             | getattr(mmap, "MAP_FIXED", 0x10))
    got = _libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if got != address:  # (left mapped: freed with the communicator, as before)
        log.debug("engine: could not release a closed segment's pages: %s",
                  os.strerror(ctypes.get_errno()))


def _serve_fd(backend: Backend, fd: int, deadline: float) -> None:
    """Rank 0: send each peer, over its authenticated link, the socket name and a secret of
    its own; hand the fd to each connecting process of our uid that presents a rank not yet
    served and that rank's secret."""
    n = backend.world_size
    name = _NAME_PREFIX + secrets.token_hex(16).encode()
    keys = {peer: secrets.token_bytes(_SECRET_BYTES) for peer in range(1, n)}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as lsock:
        lsock.bind(name)
        lsock.listen(n)
        for peer in range(1, n):
            backend.send(name + keys[peer], peer, tag=SETUP_TAG)
        served: set[int] = set()
        while len(served) < n - 1:
            lsock.settimeout(wait_limit(max(0.01, deadline - time.monotonic())))
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                missing = sorted(set(range(1, n)) - served)
                raise RendezvousError(f"rank 0: ranks {missing} never fetched the engine "
                                      "segment") from None
            with conn:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
                _pid, uid, _gid = struct.unpack("3i", creds)
                conn.settimeout(min(1.0, max(0.01, deadline - time.monotonic())))
                try:
                    hello = recv_exactly(conn, 4 + _SECRET_BYTES)
                except OSError:
                    continue  # a stranger that says nothing: refused, the job goes on
                claimed = int.from_bytes(hello[:4], "little")
                if (uid != os.getuid() or claimed not in keys or claimed in served
                        or not hmac.compare_digest(hello[4:], keys[claimed])):
                    continue  # a stranger, or a rank twice: refused, the job goes on
                socket.send_fds(conn, [b"F"], [fd])
                served.add(claimed)


def _fetch_fd(backend: Backend, deadline: float) -> int:
    msg = bytearray(_NAME_BYTES + _SECRET_BYTES)
    backend.recv(msg, 0, tag=SETUP_TAG, timeout=max(0.01, deadline - time.monotonic()))
    name, key = bytes(msg[:_NAME_BYTES]), bytes(msg[_NAME_BYTES:])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(wait_limit(max(0.01, deadline - time.monotonic())))
        try:
            sock.connect(name)
            sock.sendall(backend.rank.to_bytes(4, "little") + key)
            _msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
        except OSError as exc:
            raise RendezvousError(f"rank {backend.rank}: cannot fetch the engine segment "
                                  f"from rank 0: {exc}") from exc
    if len(fds) != 1:
        raise RendezvousError(f"rank {backend.rank}: rank 0 sent no engine segment")
    return fds[0]


__all__ = ["SETUP_TAG", "Engine", "default_ring_bytes", "oversubscribed", "split_bytes"]
