"""The same-host engine's shared segment: one memory region mapped by every rank of a job.

:class:`SharedSegment` is made by rank 0 as an anonymous ``memfd`` and handed to the other ranks
as a file descriptor over a Unix socket (``SCM_RIGHTS``). The socket lives in Linux's abstract
namespace under a random 128-bit name that rank 0 sends only over the job's authenticated TCP
links, and rank 0 also checks each connecting process's uid (``SO_PEERCRED``) and claimed rank.
Nothing ever has a name in the file system or ``/dev/shm``: the memory is freed when the last
rank unmaps it or dies, even by SIGKILL.

The segment's layout (all offsets in bytes, control lines and slots cache-line/page aligned)::

    [0, 128)                     segment header: magic, version, ranks, slot_bytes
    ctrl_off + r * ctrl_stride   rank r's control line: u32 step, u32 sleepers, u64 pid,
                                 u64 probe address, (+32) u32 point-to-point doorbell
    slot_off + r * slot_stride   rank r's two slots (by step parity, parity_stride apart), each
                                 head_bytes of header, then slot_bytes of data
    ring_off + (d * n + s) * ring_stride
                                 the point-to-point ring from rank s to rank d (``_ring.pyx``):
                                 a control block, then ring_bytes of entries

ferro-collective's fast path (``ferro_collective.fastpath``) runs its protocol on the slots and
``ShmBackend``'s point-to-point messages run through the rings (:mod:`.rings`); this module
only makes, shares, maps and releases the memory, and keeps the process-local *failure flag*
that the fast path's waits poll: the transport raises it when a peer dies, closes or aborts.
"""

from __future__ import annotations

import hmac
import mmap
import os
import secrets
import socket
import struct
import time
from typing import TYPE_CHECKING

import numpy as np

from . import settings
from ._platform import _shm
from .errors import RendezvousError
from .handshake import recv_exactly

if TYPE_CHECKING:
    from .tcp import TcpBackend

MAGIC = 0xFE770E61
VERSION = 2
CTRL_OFF = 128
CTRL_STRIDE = 128  # two cache lines: no false sharing, no adjacent-line prefetch
HEAD_BYTES = 256
PAGE = 4096
#: the tag of the set-up messages (in ferro's own tag range, below the collectives' base)
SETUP_TAG = (1 << 32) - 3

_NAME_PREFIX = b"\0ferro-engine-"
_NAME_BYTES = len(_NAME_PREFIX) + 32
_SECRET_BYTES = 32

#: default data bytes per slot: messages up to this size go through the segment
DEFAULT_SLOT_BYTES = 1 << 20
RING_CTRL = 128
BELL_OFFSET = 32


def default_ring_bytes(nranks: int) -> int:
    """Bytes of each point-to-point ring: 256 KiB up to 8 ranks, then less (a power of two,
    at least 4 KiB) so the n*n rings stay within 16 MiB; ``FERRO_SHM_RING_BYTES`` overrides.
    (A ring's pages are only touched once its pair streams a message that large.)"""
    value = settings.SHM_RING_BYTES.get()
    if value is not None:
        return value
    size = 256 << 10
    while size > 4096 and nranks * nranks * size > (16 << 20):
        size >>= 1
    return size


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def layout(nranks: int, slot_bytes: int, ring_bytes: int | None = None) -> dict[str, int]:
    """The segment layout for ``nranks`` ranks, ``slot_bytes`` per slot and ``ring_bytes``
    per point-to-point ring (default :func:`default_ring_bytes`)."""
    if ring_bytes is None:
        ring_bytes = default_ring_bytes(nranks)
    slot_off = _align(CTRL_OFF + nranks * CTRL_STRIDE, PAGE)
    parity_stride = _align(HEAD_BYTES + slot_bytes, PAGE)
    slot_stride = 2 * parity_stride
    ring_off = slot_off + nranks * slot_stride
    ring_stride = _align(RING_CTRL + ring_bytes, PAGE)
    return {"ctrl_off": CTRL_OFF, "ctrl_stride": CTRL_STRIDE, "slot_off": slot_off,
            "slot_stride": slot_stride, "parity_stride": parity_stride,
            "head_bytes": HEAD_BYTES, "slot_bytes": slot_bytes,
            "ring_off": ring_off, "ring_stride": ring_stride, "ring_bytes": ring_bytes,
            "size": ring_off + nranks * nranks * ring_stride}


class SharedSegment:
    """This rank's mapping of the job's segment; made with :meth:`join` (collective)."""

    def __init__(self, rank: int, nranks: int, mem: mmap.mmap, lay: dict[str, int]) -> None:
        self.rank = rank
        self.nranks = nranks
        self.layout = lay
        self._mem = mem
        self._bytes = np.frombuffer(mem, dtype=np.uint8)
        self.address = self._bytes.ctypes.data
        #: process-local failure flag (u32) that the fast path's waits poll
        self.failed = np.zeros(1, dtype=np.uint32)
        self.failed_address = self.failed.ctypes.data
        #: payload bytes this rank wrote into the segment / read from it or from peers' memory
        self.sent = 0
        self.received = 0
        #: every rank's pid, and whether every rank may read every other's memory (CMA)
        self.pids: list[int] = []
        self.cma_ok = False

    def mark_failed(self) -> None:
        """A peer died, closed or aborted (or this rank closed): waiting calls give up now
        (the flag is set, then every rank's step word is woken, so no sleeper waits out its
        sleep slice)."""
        self.failed[0] = 1
        if self._bytes is not None:
            for rank in range(self.nranks):
                _shm.futex_wake(self.address + self.ctrl(rank))
                if rank != self.rank:  # point-to-point waits: receives, and senders
                    _shm.futex_wake(self.ring(rank, self.rank)[0])  # ring head
                    _shm.futex_wake(self.ring(self.rank, rank)[0] + 64)  # ring tail

    def close(self) -> None:
        self.mark_failed()
        self._bytes = None
        try:
            self._mem.close()
        except BufferError:  # views still alive somewhere: the GC unmaps it later
            pass

    # ------------------------------------------------------------------ set-up
    @classmethod
    def join(cls, backend: TcpBackend, slot_bytes: int = DEFAULT_SLOT_BYTES,
             timeout: float | None = None) -> SharedSegment:
        """Make (rank 0) or receive (others) the job's segment; every rank calls it.

        Raises RendezvousError naming the rank and what failed.
        """
        rank, n = backend.rank, backend.world_size
        lay = layout(n, slot_bytes)
        deadline = time.monotonic() + (backend.timeout if timeout is None else timeout)
        if rank == 0:
            fd = os.memfd_create("ferro-engine", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, lay["size"])
                _serve_fd(backend, fd, deadline)
                mem = mmap.mmap(fd, lay["size"])
            finally:
                os.close(fd)
            struct.pack_into("<IIIQQ", mem, 0, MAGIC, VERSION, n, slot_bytes, lay["ring_bytes"])
        else:
            fd = _fetch_fd(backend, deadline)
            try:
                mem = mmap.mmap(fd, lay["size"])
            finally:
                os.close(fd)
        seg = cls(rank, n, mem, lay)
        # every rank's pid and a probe word, for the cross-memory-read check below
        probe = np.array([0xC0FFEE00 + rank], dtype=np.uint64)
        struct.pack_into("<QQ", mem, seg.ctrl(rank) + 8, os.getpid(), probe.ctypes.data)
        backend.barrier(timeout=max(0.05, deadline - time.monotonic()))  # every rank mapped it
        magic, version, nranks, sb, rb = struct.unpack_from("<IIIQQ", mem, 0)
        if (magic, version, nranks, sb, rb) != (MAGIC, VERSION, n, slot_bytes, lay["ring_bytes"]):
            raise RendezvousError(f"rank {rank}: the engine segment is not this job's "
                                  f"(magic {magic:#x}, version {version}, {nranks} ranks, "
                                  f"slot {sb}, ring {rb}; expected ring {lay['ring_bytes']} "
                                  "bytes: is FERRO_SHM_RING_BYTES the same on every rank?)")
        seg.pids = [struct.unpack_from("<Q", mem, seg.ctrl(r) + 8)[0] for r in range(n)]
        mine = b"\x01" if all(_can_read(mem, seg, r) for r in range(n) if r != rank) else b"\x00"
        flags = bytearray(n)
        flags[rank] = mine[0]
        for peer in range(n):
            if peer != rank:
                backend.send(mine, peer, tag=SETUP_TAG)
        for peer in range(n):
            if peer != rank:
                backend.recv(memoryview(flags)[peer:peer + 1], peer, tag=SETUP_TAG,
                             timeout=max(0.05, deadline - time.monotonic()))
        seg.cma_ok = all(flags) and settings.SHM_CMA.get() != "never"
        backend.barrier(timeout=max(0.05, deadline - time.monotonic()))  # probes read
        return seg

    def ctrl(self, rank: int) -> int:
        """Offset of ``rank``'s control line."""
        return self.layout["ctrl_off"] + rank * self.layout["ctrl_stride"]

    def bell(self, rank: int) -> int:
        """Address of ``rank``'s point-to-point doorbell (rung by producers about to wait)."""
        return self.address + self.ctrl(rank) + BELL_OFFSET

    def ring(self, src: int, dst: int) -> tuple[int, int, int]:
        """The ring from ``src`` to ``dst``: addresses of its control block and data, and its
        capacity in bytes."""
        lay = self.layout
        ctrl = self.address + lay["ring_off"] + (dst * self.nranks + src) * lay["ring_stride"]
        return ctrl, ctrl + RING_CTRL, lay["ring_bytes"]


def _can_read(mem: mmap.mmap, seg: SharedSegment, peer: int) -> bool:
    """True if this process may read ``peer``'s memory (cross-memory attach)."""
    pid, addr = struct.unpack_from("<QQ", mem, seg.ctrl(peer) + 8)
    out = np.zeros(1, dtype=np.uint64)
    try:
        _shm.cma_read(pid, addr, out.view(np.uint8))
    except OSError:
        return False
    return int(out[0]) == 0xC0FFEE00 + peer


def _serve_fd(backend: TcpBackend, fd: int, deadline: float) -> None:
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
            lsock.settimeout(max(0.01, deadline - time.monotonic()))
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


def _fetch_fd(backend: TcpBackend, deadline: float) -> int:
    msg = bytearray(_NAME_BYTES + _SECRET_BYTES)
    backend.recv(msg, 0, tag=SETUP_TAG, timeout=max(0.01, deadline - time.monotonic()))
    name, key = bytes(msg[:_NAME_BYTES]), bytes(msg[_NAME_BYTES:])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
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
