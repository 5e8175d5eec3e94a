# cython: language_level=3
"""The synchronization kernel of the same-host collective engine (a shared segment of ranks).

The segment (made and shared by ``ferro_backend.engine``) holds, per rank, a control line (a
32-bit *step* counter, a sleeper count) and two slots (by step parity) of a header area plus
``slot_bytes`` of data. A rank takes part in step ``s`` by writing its slot ``s % 2`` and then
publishing ``step = s`` (release); it waits until every rank has published ``s`` (acquire).
Slot ``s % 2`` is free again at step ``s + 2``: a rank publishes ``s + 1`` only after it has
finished reading everyone's step-``s`` slots, and nobody writes step ``s + 2`` before seeing
every rank at ``s + 1``.

Waiting is a bounded spin (with a CPU pause) and then a futex sleep on the peer's step word, all
without the GIL; the sleep wakes when the peer publishes (it wakes sleepers) and at least every
50 ms to check this process's failure flag (set by the transport when a peer dies or aborts)
and the deadline. Validation (layout, sizes, addresses) is done by ``fastpath.py``.
"""

from libc.stdint cimport int32_t, uint32_t
from libc.string cimport memcmp, memcpy

cdef extern from *:
    """
    #include <stdint.h>
    #include <time.h>
    #include <limits.h>
    #include <unistd.h>
    #include <sys/syscall.h>
    #include <linux/futex.h>

    static inline uint32_t ferro_load(uint32_t* p) {
        return __atomic_load_n(p, __ATOMIC_SEQ_CST);
    }
    static inline void ferro_store(uint32_t* p, uint32_t v) {
        __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    }
    static inline void ferro_add(uint32_t* p, int32_t v) {
        __atomic_fetch_add(p, (uint32_t)v, __ATOMIC_SEQ_CST);
    }
    static inline void ferro_pause(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__)
        __asm__ __volatile__("yield");
    #endif
    }
    static inline double ferro_now(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    }
    static inline void ferro_futex_wait(uint32_t* p, uint32_t seen, double seconds) {
        struct timespec ts;
        if (seconds < 0) seconds = 0;
        ts.tv_sec = (time_t)seconds;
        ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
        syscall(SYS_futex, p, FUTEX_WAIT, seen, &ts, NULL, 0);
    }
    static inline void ferro_futex_wake(uint32_t* p) {
        syscall(SYS_futex, p, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
    """
    uint32_t ferro_load(uint32_t* p) noexcept nogil
    void ferro_store(uint32_t* p, uint32_t v) noexcept nogil
    void ferro_add(uint32_t* p, int32_t v) noexcept nogil
    void ferro_pause() noexcept nogil
    double ferro_now() noexcept nogil
    void ferro_futex_wait(uint32_t* p, uint32_t seen, double seconds) noexcept nogil
    void ferro_futex_wake(uint32_t* p) noexcept nogil

# status codes (C globals: usable without the GIL)
cdef int OK = 0, TIMEOUT = 1, FAILED = 2, MISMATCH = 3

#: status codes of exchange() and wait()
STATUS_OK, STATUS_TIMEOUT, STATUS_FAILED, STATUS_MISMATCH = OK, TIMEOUT, FAILED, MISMATCH

cdef double SLEEP_SLICE = 0.05


cdef class SlotEngine:
    """This rank's view of one engine segment (addresses and layout as plain integers)."""

    cdef unsigned char* base
    cdef int n, me, spin
    cdef size_t ctrl_off, ctrl_stride, slot_off, slot_stride, parity_stride, head_bytes
    cdef size_t slot_bytes
    cdef uint32_t* failed

    def __init__(self, size_t base, int n, int me, size_t ctrl_off, size_t ctrl_stride,
                 size_t slot_off, size_t slot_stride, size_t parity_stride, size_t head_bytes,
                 size_t slot_bytes, size_t failed_addr, int spin):
        self.base = <unsigned char*>base
        self.n, self.me, self.spin = n, me, spin
        self.ctrl_off, self.ctrl_stride = ctrl_off, ctrl_stride
        self.slot_off, self.slot_stride, self.parity_stride = slot_off, slot_stride, parity_stride
        self.head_bytes, self.slot_bytes = head_bytes, slot_bytes
        self.failed = <uint32_t*>failed_addr

    cdef inline uint32_t* _step(self, int rank) noexcept nogil:
        return <uint32_t*>(self.base + self.ctrl_off + rank * self.ctrl_stride)

    cdef inline uint32_t* _sleepers(self, int rank) noexcept nogil:
        return <uint32_t*>(self.base + self.ctrl_off + rank * self.ctrl_stride + 4)

    cdef inline unsigned char* _slot(self, int rank, uint32_t step) noexcept nogil:
        return (self.base + self.slot_off + rank * self.slot_stride
                + (step & 1) * self.parity_stride)

    cdef void _publish(self, uint32_t step) noexcept nogil:
        ferro_store(self._step(self.me), step)
        if ferro_load(self._sleepers(self.me)) != 0:
            ferro_futex_wake(self._step(self.me))

    cdef int _wait_for(self, int rank, uint32_t step, double deadline) noexcept nogil:
        cdef uint32_t* word = self._step(rank)
        cdef uint32_t seen
        cdef int spins = 0
        cdef double now
        while <int32_t>(ferro_load(word) - step) < 0:
            if spins < self.spin:
                ferro_pause()
                spins += 1
                continue
            if ferro_load(self.failed) != 0:
                return FAILED
            now = ferro_now()
            if now >= deadline:
                return TIMEOUT
            ferro_add(self._sleepers(rank), 1)
            seen = ferro_load(word)
            if <int32_t>(seen - step) < 0:
                ferro_futex_wait(word, seen, min(SLEEP_SLICE, deadline - now))
            ferro_add(self._sleepers(rank), -1)
        return OK

    cdef int _wait_all(self, uint32_t step, double deadline) noexcept nogil:
        cdef int j, rc
        for j in range(self.n):
            if j != self.me:
                rc = self._wait_for(j, step, deadline)
                if rc != OK:
                    return rc
        return OK

    def exchange(self, uint32_t step, const unsigned char[::1] header, size_t src,
                 size_t nbytes, double deadline):
        """Write ``header`` and ``nbytes`` at address ``src`` (0: none) into this rank's slot
        for ``step``, publish, and wait (until ``deadline``, a time.monotonic() value) for
        every rank's step; then compare the first ``len(header)`` header bytes of all slots.
        Returns OK, TIMEOUT, FAILED or MISMATCH."""
        cdef Py_ssize_t hlen = header.shape[0]
        cdef unsigned char* mine = self._slot(self.me, step)
        cdef int j, rc
        with nogil:
            memcpy(mine, &header[0], hlen)
            if nbytes:
                memcpy(mine + self.head_bytes, <const void*>src, nbytes)
            self._publish(step)
            rc = self._wait_all(step, deadline)
            if rc == OK:
                for j in range(self.n):
                    if memcmp(self._slot(j, step), mine, hlen) != 0:
                        rc = MISMATCH
                        break
        return rc

    def publish(self, uint32_t step):
        """Publish ``step`` for this rank (no slot write)."""
        with nogil:
            self._publish(step)

    def wait(self, uint32_t step, double deadline):
        """Wait until every rank has published ``step``; OK, TIMEOUT or FAILED."""
        cdef int rc
        with nogil:
            rc = self._wait_all(step, deadline)
        return rc

    def published(self, int rank):
        """The last step ``rank`` published (for error messages)."""
        return ferro_load(self._step(rank))

    def slot_address(self, int rank, uint32_t step):
        """Address of ``rank``'s slot header for ``step`` (data follows after the header)."""
        return <size_t>self._slot(rank, step)
