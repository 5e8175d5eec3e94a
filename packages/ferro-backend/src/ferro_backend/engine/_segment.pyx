# cython: language_level=3
"""The segment's own words, and single-copy moves between the processes that map it.

:class:`SegmentMap` is this rank's view of a mapped segment by address: the layout of
``_layout.h`` (:meth:`SegmentMap.layout`, the offsets Python may use), the segment header,
every rank's identity (pid and probe address); the failure flag and its wake-ups are the door's
(``door.c``: ferro_comm_mark_failed). ``cma_read``/``cma_write``
copy between this process's memory and a peer's with one kernel copy (``process_vm_readv`` /
``process_vm_writev``, the GIL released), as Open MPI and MPICH move large messages between
the processes of one host. Validation lives in ``segment.py``.
"""

from libc.errno cimport errno

include "_engine.pxi"

from ferro.engine cimport FERRO_INVALID


cdef extern from "_probe.h" nogil:
    int FERRO_PROBE_MAX_ROUNDS
    int FERRO_PROBE_ROUNDS, FERRO_PROBE_COPIES
    size_t FERRO_PROBE_BYTES
    int ferro_probe_links(unsigned char* base, const ferro_layout* L, int rank,
                          int rounds, int copies, size_t nbytes, unsigned char* scratch,
                          double deadline, const uint32_t* failed, double* rtt_ns,
                          double* copy_gbps)


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len
    ssize_t process_vm_readv(int pid, const iovec* local_iov, unsigned long liovcnt,
                             const iovec* remote_iov, unsigned long riovcnt,
                             unsigned long flags)
    ssize_t process_vm_writev(int pid, const iovec* local_iov, unsigned long liovcnt,
                              const iovec* remote_iov, unsigned long riovcnt,
                              unsigned long flags)


cdef extern from "<sys/prctl.h>" nogil:
    int prctl(int option, unsigned long arg2, unsigned long arg3, unsigned long arg4,
              unsigned long arg5)
    int PR_SET_PTRACER

MAGIC, VERSION = FERRO_MAGIC, FERRO_SEGMENT_VERSION
#: the bytes of a link probe's copies (at most a slot; _probe.h)
PROBE_BYTES = FERRO_PROBE_BYTES
#: the room of a collective header at the start of each slot
HEADER_ROOM = FERRO_HEADER_ROOM


def layout(int nranks, size_t slot_bytes, size_t ring_bytes) -> dict:
    """The segment's layout for ``nranks`` ranks (offsets and strides in bytes)."""
    cdef ferro_layout L
    ferro_layout_init(&L, nranks, slot_bytes, ring_bytes)
    return {"ctrl_off": L.ctrl_off, "slot_off": L.slot_off, "slot_stride": L.slot_stride,
            "parity_stride": L.parity_stride, "head_bytes": sizeof(ferro_slot_head),
            "slot_bytes": slot_bytes, "ring_off": L.ring_off, "ring_stride": L.ring_stride,
            "ring_bytes": ring_bytes, "door_ring_off": L.door_ring_off, "size": L.size}


cdef class SegmentMap:
    """Rank ``rank``'s view of the mapped ``segment`` (its bytes: holding them keeps the mapping
    alive), with this process's failure flag (a u32) at ``failed_addr``."""

    cdef unsigned char* base
    cdef object _keep
    cdef ferro_layout L
    cdef readonly int rank
    cdef uint32_t* failed

    def __init__(self, unsigned char[::1] segment, int nranks, int rank, size_t slot_bytes,
                 size_t ring_bytes, size_t failed_addr):
        if not 0 <= rank < nranks:
            raise ValueError(f"SegmentMap: rank {rank} is not one of {nranks} ranks")
        ferro_layout_init(&self.L, nranks, slot_bytes, ring_bytes)
        if <size_t>segment.shape[0] < self.L.size:
            raise ValueError(f"SegmentMap: {segment.shape[0]} bytes, the layout needs {self.L.size}")
        self.base, self._keep = &segment[0], segment
        self.rank = rank
        self.failed = <uint32_t*>failed_addr

    def write_head(self, uint64_t split_bytes=0):
        """Rank 0: stamp the segment with its magic, version and sizes, and the group's split
        allreduce threshold (:meth:`split_bytes`)."""
        cdef ferro_seg_head* h = ferro_head_of(self.base)
        h.magic, h.version, h.nranks = FERRO_MAGIC, FERRO_SEGMENT_VERSION, self.L.nranks
        h.slot_bytes, h.ring_bytes = self.L.slot_bytes, self.L.ring_bytes
        h.split_bytes = split_bytes

    def split_bytes(self) -> int:
        """The split allreduce threshold rank 0 stamped (every rank must use the same)."""
        return ferro_head_of(self.base).split_bytes

    def head(self) -> tuple:
        """``(magic, version, nranks, slot_bytes, ring_bytes)`` as stamped by rank 0."""
        cdef ferro_seg_head* h = ferro_head_of(self.base)
        return h.magic, h.version, h.nranks, h.slot_bytes, h.ring_bytes

    def expected_head(self) -> tuple:
        """The :meth:`head` this rank expects."""
        return (FERRO_MAGIC, FERRO_SEGMENT_VERSION, self.L.nranks, self.L.slot_bytes,
                self.L.ring_bytes)

    def set_identity(self, uint64_t pid, uint64_t probe):
        """This rank's process id and the address of its probe word."""
        cdef ferro_ctrl* c = ferro_ctrl_of(self.base, &self.L, self.rank)
        c.pid, c.probe = pid, probe

    def identity(self, int rank) -> tuple:
        """``(pid, probe address)`` of ``rank``."""
        self._check_rank(rank)
        cdef ferro_ctrl* c = ferro_ctrl_of(self.base, &self.L, rank)
        return c.pid, c.probe

    def probe_links(self, double timeout, int rounds=FERRO_PROBE_ROUNDS,
                    int copies=FERRO_PROBE_COPIES, size_t nbytes=FERRO_PROBE_BYTES) -> tuple:
        """The link probe (``_probe.h``; every rank at once, the segment's next probe):
        ``(round trip of a cache line in ns, GB/s of a copy between the ranks' cores)``, the
        slowest peer's, the same on every rank. The GIL released; it spins.

        Raises TimeoutError after ``timeout`` seconds, ConnectionError when the failure flag
        rises, ValueError for rounds, copies or bytes out of range."""
        cdef unsigned char[::1] scratch = bytearray(max(nbytes, 1))
        cdef double rtt = 0, gbps = 0, deadline = ferro_now() + timeout
        cdef int rc
        with nogil:
            rc = ferro_probe_links(self.base, &self.L, self.rank, rounds, copies,
                                   nbytes, &scratch[0], deadline, self.failed, &rtt, &gbps)
        if rc == FERRO_INVALID:
            raise ValueError(f"probe_links: rounds {rounds} and copies {copies} must be 1.."
                             f"{FERRO_PROBE_MAX_ROUNDS}, bytes {nbytes} 1..{self.L.slot_bytes}")
        if rc == FERRO_TIMEOUT:
            raise TimeoutError(f"rank {self.rank}: the link probe timed out after {timeout:g}s "
                               "(a rank did not take part)")
        if rc != FERRO_OK:
            raise ConnectionError(f"rank {self.rank}: the link probe ended: a peer failed")
        return rtt, gbps

    def link_state(self) -> tuple:
        """``(probes, round trip ns, copy GB/s, when)``: how many link probes the segment has
        run (the door's re-probes included) and the last one's results, as rank 0 stamped
        them (``when``: seconds since the epoch)."""
        cdef ferro_seg_head* h = ferro_head_of(self.base)
        cdef uint32_t probes = h.probes  # (stamped last: x86 keeps loads in order)
        return probes, h.link_rtt_ns, h.link_copy_gbps, h.link_at

    cdef int _check_rank(self, int rank) except -1:
        if not 0 <= rank < self.L.nranks:
            raise ValueError(f"SegmentMap: rank {rank} is not one of {self.L.nranks} ranks")
        return 0


cdef Py_ssize_t _move(int pid, size_t remote, unsigned char* local, Py_ssize_t n, bint write,
                      int* err) noexcept nogil:
    """Read (or write) ``n`` bytes; returns the count moved (short only on error, ``err``
    set)."""
    cdef iovec liov, riov
    cdef Py_ssize_t done = 0
    cdef ssize_t got
    while done < n:
        liov.iov_base = local + done
        liov.iov_len = n - done
        riov.iov_base = <void*>(remote + done)
        riov.iov_len = n - done
        if write:
            got = process_vm_writev(pid, &liov, 1, &riov, 1, 0)
        else:
            got = process_vm_readv(pid, &liov, 1, &riov, 1, 0)
        if got <= 0:
            err[0] = errno if got < 0 else 5  # EIO on a zero-length read
            return done
        done += got
    return done


def cma_read(int pid, size_t remote_addr, unsigned char[::1] out):
    """Copy ``len(out)`` bytes at ``remote_addr`` in process ``pid`` into ``out``.

    Raises OSError (EPERM where the kernel forbids it, ESRCH if the process is gone, EFAULT
    for a bad address).
    """
    cdef Py_ssize_t n = out.shape[0], got
    cdef int err = 0
    if n == 0:
        return
    with nogil:
        got = _move(pid, remote_addr, &out[0], n, False, &err)
    if got != n:
        import os
        raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)} after "
                           f"{got} of {n} bytes")


def cma_write(int pid, size_t remote_addr, const unsigned char[::1] data):
    """Copy ``data`` to ``remote_addr`` in process ``pid`` (errors as :func:`cma_read`)."""
    cdef Py_ssize_t n = data.shape[0], got
    cdef int err = 0
    if n == 0:
        return
    with nogil:
        got = _move(pid, remote_addr, <unsigned char*>&data[0], n, True, &err)
    if got != n:
        import os
        raise OSError(err, f"process_vm_writev to pid {pid}: {os.strerror(err)} after "
                           f"{got} of {n} bytes")


def allow_peers_to_read() -> bool:
    """Let sibling processes read this one's memory where Yama restricts it to ancestors."""
    cdef int rc
    with nogil:
        rc = prctl(PR_SET_PTRACER, <unsigned long>0xFFFFFFFFFFFFFFFF, 0, 0, 0)
    return rc == 0
