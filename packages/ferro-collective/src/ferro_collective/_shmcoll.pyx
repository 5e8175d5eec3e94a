# cython: language_level=3
"""The synchronization kernel of the same-host collective engine (a shared segment of ranks).

The segment (made and shared by ``ferro_backend.engine``) holds, per rank, a control line (a
32-bit *step* counter, a sleeper count) and two slots (by step parity) of a header area plus
``slot_bytes`` of data. A rank takes part in step ``s`` by writing its slot ``s % 2`` and then
publishing ``step = s`` (release); it waits until every rank has published ``s`` (acquire).
Slot ``s % 2`` is free again at step ``s + 2``: a rank publishes ``s + 1`` only after it has
finished reading everyone's step-``s`` slots, and nobody writes step ``s + 2`` before seeing
every rank at ``s + 1``.

Waiting is a bounded spin (with a CPU pause; when the ranks outnumber the cores, a bounded run of
``sched_yield`` instead, which hands the core to a peer that needs it) and then a futex sleep on
the peer's step word, all
without the GIL; the sleep wakes when the peer publishes (it wakes sleepers) and at least every
50 ms to check this process's failure flag (set by the transport when a peer dies or aborts)
and the deadline. Validation (layout, sizes, addresses) is done by ``fastpath.py`` and
``engine_group.py``.

The one-call collectives (:meth:`SlotEngine.step_fold`, :meth:`SlotEngine.step_copy`) run a
whole small collective in one call without the GIL: header (with this call's sequence number
patched in) and data into the slot, publish, wait, compare headers, then fold or copy every
rank's slot data straight from the segment (the reduction loops of ``_kernels.pxi``).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp

include "_kernels.pxi"

cdef extern from *:
    """
    #include <stdint.h>
    #include <time.h>
    #include <limits.h>
    #include <unistd.h>
    #include <sys/syscall.h>
    #include <linux/futex.h>
    #include <sched.h>

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
    int sched_yield() noexcept nogil

# status codes (C globals: usable without the GIL)
cdef int OK = 0, TIMEOUT = 1, FAILED = 2, MISMATCH = 3

#: status codes of exchange() and wait()
STATUS_OK, STATUS_TIMEOUT, STATUS_FAILED, STATUS_MISMATCH = OK, TIMEOUT, FAILED, MISMATCH

cdef double SLEEP_SLICE = 0.05

#: where a collective header holds its 32-bit little-endian sequence number (header.py's
#: layout; a test holds the two equal)
HEADER_SEQ_OFFSET = 24
cdef size_t SEQ_OFF = 24

# bytes per item of each dtype code of _kernels.pxi (F32 .. U64)
cdef Py_ssize_t ITEMSIZE[10]
ITEMSIZE[:] = [4, 8, 1, 2, 4, 8, 1, 2, 4, 8]


cdef class SlotEngine:
    """This rank's view of one engine segment (addresses and layout as plain integers)."""

    cdef unsigned char* base
    cdef int n, me, spin, yields
    cdef size_t ctrl_off, ctrl_stride, slot_off, slot_stride, parity_stride, head_bytes
    cdef size_t slot_bytes
    cdef uint32_t* failed

    def __init__(self, size_t base, int n, int me, size_t ctrl_off, size_t ctrl_stride,
                 size_t slot_off, size_t slot_stride, size_t parity_stride, size_t head_bytes,
                 size_t slot_bytes, size_t failed_addr, int spin, int yields=0):
        self.base = <unsigned char*>base
        self.n, self.me, self.spin, self.yields = n, me, spin, yields
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
            # the deadline first: a wait that is already late times out whatever happened
            # since (a peer that gave up at its own deadline and closed, say)
            now = ferro_now()
            if now >= deadline:
                return TIMEOUT
            if ferro_load(self.failed) != 0:
                return FAILED
            if spins < self.spin + self.yields:
                sched_yield()
                spins += 1
                continue
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

    cdef int _exchange(self, uint32_t step, const unsigned char* header, size_t hlen,
                       bint patch, uint32_t seq, const unsigned char* src, size_t nbytes,
                       double deadline) noexcept nogil:
        """Header (``seq`` written at SEQ_OFF when ``patch``) and ``nbytes`` at ``src`` into
        this rank's slot for ``step``, publish, wait for every rank, compare headers."""
        cdef unsigned char* mine = self._slot(self.me, step)
        cdef int j, rc
        memcpy(mine, header, hlen)
        if patch:
            mine[SEQ_OFF] = seq & 0xFF
            mine[SEQ_OFF + 1] = (seq >> 8) & 0xFF
            mine[SEQ_OFF + 2] = (seq >> 16) & 0xFF
            mine[SEQ_OFF + 3] = (seq >> 24) & 0xFF
        if nbytes:
            memcpy(mine + self.head_bytes, src, nbytes)
        self._publish(step)
        rc = self._wait_all(step, deadline)
        if rc == OK:
            for j in range(self.n):
                if memcmp(self._slot(j, step), mine, hlen) != 0:
                    return MISMATCH
        return rc

    cdef int _fold_slots(self, uint32_t step, unsigned char* out, size_t offset,
                         Py_ssize_t count, int code, int op, double mean_divisor) noexcept nogil:
        """``out`` = the rank-order fold of ``count`` items at byte ``offset`` of every rank's
        slot data of ``step``; -1 for an unknown dtype code or no memory."""
        cdef const void* few[64]
        cdef const void** ptrs = few
        cdef int j, rc
        if self.n > 64:
            ptrs = <const void**>malloc(self.n * sizeof(void*))
            if ptrs == NULL:
                return -1
        for j in range(self.n):
            ptrs[j] = self._slot(j, step) + self.head_bytes + offset
        rc = fold_raw(code, out, ptrs, self.n, count, op, mean_divisor)
        if ptrs != few:
            free(ptrs)
        return rc

    def exchange(self, uint32_t step, const unsigned char[::1] header, size_t src,
                 size_t nbytes, double deadline):
        """Write ``header`` and ``nbytes`` at address ``src`` (0: none) into this rank's slot
        for ``step``, publish, and wait (until ``deadline``, a time.monotonic() value) for
        every rank's step; then compare the first ``len(header)`` header bytes of all slots.
        Returns OK, TIMEOUT, FAILED or MISMATCH."""
        cdef int rc
        with nogil:
            rc = self._exchange(step, &header[0], header.shape[0], False, 0,
                                <const unsigned char*>src, nbytes, deadline)
        return rc

    def step(self, uint32_t step, bytes header not None, uint32_t seq,
             double deadline):
        """A step with no data (the barrier): :meth:`exchange` of ``header`` with ``seq``
        patched in; OK, TIMEOUT, FAILED or MISMATCH."""
        cdef int rc
        cdef const unsigned char* h = header
        cdef Py_ssize_t hlen = len(header)
        with nogil:
            rc = self._exchange(step, h, hlen, True, seq, NULL, 0, deadline)
        return rc

    def step_fold(self, uint32_t step, bytes header not None, uint32_t seq,
                  object src, object out, size_t offset, Py_ssize_t count, int code, int op,
                  double mean_divisor, double deadline):
        """One whole reduction step: :meth:`exchange` of ``header`` with ``seq`` patched in
        and the bytes of ``src`` (a C-contiguous buffer); then, when that returns OK,
        ``out``'s first ``count`` items (dtype ``code``) become the rank-order fold of every
        rank's slot data from byte ``offset`` (MEAN's divide fused when ``mean_divisor`` > 0).
        Returns OK, TIMEOUT, FAILED or MISMATCH (``out`` untouched unless OK)."""
        cdef Py_buffer s, o
        cdef int rc
        cdef const unsigned char* h = header
        cdef Py_ssize_t hlen = len(header)
        self._buffers(src, out, &s, &o)
        try:
            self._check_fold(s.len, o.len, offset, count, code)
            with nogil:
                rc = self._exchange(step, h, hlen, True, seq,
                                    <const unsigned char*>s.buf, s.len, deadline)
                if rc == OK and count > 0:
                    rc = self._fold_slots(step, <unsigned char*>o.buf, offset, count, code, op,
                                          mean_divisor)
        finally:
            PyBuffer_Release(&s)
            PyBuffer_Release(&o)
        if rc == -1:
            raise MemoryError()
        return rc

    def fold(self, uint32_t step, object out, size_t nbytes, size_t offset, Py_ssize_t count,
             int code, int op, double mean_divisor):
        """The fold of :meth:`step_fold` alone (slot data of ``nbytes``), for a step whose
        wait ended later."""
        cdef Py_buffer o
        cdef int rc
        PyObject_GetBuffer(out, &o, PyBUF_WRITABLE)
        try:
            self._check_fold(nbytes, o.len, offset, count, code)
            with nogil:
                rc = self._fold_slots(step, <unsigned char*>o.buf, offset, count, code, op,
                                      mean_divisor)
        finally:
            PyBuffer_Release(&o)
        if rc != 0:
            raise MemoryError()

    cdef int _check_fold(self, Py_ssize_t nbytes, Py_ssize_t out_len, size_t offset,
                         Py_ssize_t count, int code) except -1:
        cdef Py_ssize_t item = ITEMSIZE[code] if 0 <= code < 10 else 0
        if item == 0:
            raise ValueError(f"fold: unknown dtype code {code}")
        if (count < 0 or <size_t>nbytes > self.slot_bytes
                or offset + <size_t>(count * item) > <size_t>nbytes or count * item > out_len):
            raise ValueError(f"fold: {count} items of {item} bytes at offset {offset} do not "
                             f"fit {nbytes} bytes of slot data (slot {self.slot_bytes}) or "
                             f"an output of {out_len} bytes")
        return 0

    cdef int _buffers(self, object src, object out, Py_buffer* s, Py_buffer* o) except -1:
        PyObject_GetBuffer(src, s, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(out, o, PyBUF_WRITABLE)
        except BaseException:
            PyBuffer_Release(s)
            raise
        return 0

    def step_copy(self, uint32_t step, bytes header not None, uint32_t seq,
                  object src, object out, int root, double deadline):
        """One whole broadcast (``root`` >= 0: every rank copies ``len(src)`` bytes from
        ``root``'s slot into ``out``; only the root sends data) or all_gather (``root`` = -1:
        block ``r`` of ``out`` comes from rank ``r``'s slot, this rank's own from ``src``)
        step; OK, TIMEOUT, FAILED or MISMATCH (nothing copied unless OK)."""
        cdef Py_buffer s, o
        cdef int rc
        cdef const unsigned char* h = header
        cdef Py_ssize_t hlen = len(header)
        self._buffers(src, out, &s, &o)
        try:
            self._check_copy(s.len, o.len, root)
            with nogil:
                rc = self._exchange(step, h, hlen, True, seq,
                                    <const unsigned char*>s.buf,
                                    s.len if root < 0 or root == self.me else 0, deadline)
                if rc == OK:
                    self._copy_slots(step, <unsigned char*>o.buf,
                                     <const unsigned char*>s.buf, s.len, root)
        finally:
            PyBuffer_Release(&s)
            PyBuffer_Release(&o)
        return rc

    def copy(self, uint32_t step, object src, object out, int root):
        """The copies of :meth:`step_copy` alone, for a step whose wait ended later."""
        cdef Py_buffer s, o
        self._buffers(src, out, &s, &o)
        try:
            self._check_copy(s.len, o.len, root)
            with nogil:
                self._copy_slots(step, <unsigned char*>o.buf, <const unsigned char*>s.buf,
                                 s.len, root)
        finally:
            PyBuffer_Release(&s)
            PyBuffer_Release(&o)

    cdef int _check_copy(self, Py_ssize_t nbytes, Py_ssize_t out_len, int root) except -1:
        if root >= self.n or root < -1:
            raise ValueError(f"copy: root {root} is not a rank of {self.n} (or -1)")
        cdef Py_ssize_t want = nbytes if root >= 0 else nbytes * self.n
        if <size_t>nbytes > self.slot_bytes or out_len != want:
            raise ValueError(f"copy: {nbytes} bytes per rank (slot {self.slot_bytes}) do not "
                             f"fill an output of {out_len} bytes")
        return 0

    cdef void _copy_slots(self, uint32_t step, unsigned char* out, const unsigned char* src,
                          size_t nbytes, int root) noexcept nogil:
        cdef int j
        if root >= 0:
            if root != self.me:
                memcpy(out, self._slot(root, step) + self.head_bytes, nbytes)
            elif <const unsigned char*>out != src:
                memcpy(out, src, nbytes)
            return
        for j in range(self.n):
            if j == self.me:
                if <const unsigned char*>(out + j * nbytes) != src:
                    memcpy(out + j * nbytes, src, nbytes)
            else:
                memcpy(out + j * nbytes, self._slot(j, step) + self.head_bytes, nbytes)

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
