# cython: language_level=3
"""Point-to-point rings of the same-host engine: one single-producer, single-consumer byte ring
per ordered pair of ranks, in the job's shared segment (``engine.py`` lays them out).

A ring is a control block and ``cap`` bytes of data (``cap`` a power of two)::

    ctrl + 0    u32 head: bytes ever written, mod 2**32 (the producer stores it, release)
    ctrl + 4    u32 consumer sleepers (futex waiters on head)
    ctrl + 64   u32 tail: bytes ever consumed, mod 2**32 (the consumer stores it, release)
    ctrl + 68   u32 producer sleepers (futex waiters on tail)
    data        entries, each a 32-byte header and its payload, 64-byte aligned; an entry
                never wraps: a PAD entry fills the end of the data area instead

Entry header: u32 kind, u32 len (payload bytes; for a CMA entry the status the consumer writes
back), u64 tag, u64 total (bytes of the whole message), u64 aux (a chunk's offset in its
message; a CMA entry's address in the sender).

The producer (under its process's per-ring lock) waits for space, writes the entry and publishes
``head``; the consumer (under its per-ring lock) reads the entry at ``tail`` and publishes the
new ``tail``. Either side's wait is a bounded spin (with a CPU pause, or ``sched_yield`` when the
ranks outnumber the cores) and then a futex sleep that the other side wakes, all without the
GIL; a sleep wakes at least every 50 ms to check the deadline and, when asked, this process's
failure flag (raised by the transport when a peer dies, closes or aborts). A producer about to
sleep first rings the consumer's *doorbell* (a counter in the consumer rank's control line):
the consumer's :class:`Watch` then drains a ring nobody else is draining. Framing of messages
(eager, chunked, by cross-memory descriptor) and matching are ``shm.py``'s.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.string cimport memcpy

cdef extern from *:
    """
    #include <stdint.h>
    #include <time.h>
    #include <limits.h>
    #include <unistd.h>
    #include <sys/syscall.h>
    #include <linux/futex.h>
    #include <sched.h>

    static inline uint32_t ring_load(uint32_t* p) {
        return __atomic_load_n(p, __ATOMIC_SEQ_CST);
    }
    static inline void ring_store(uint32_t* p, uint32_t v) {
        __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    }
    static inline void ring_add(uint32_t* p, int32_t v) {
        __atomic_fetch_add(p, (uint32_t)v, __ATOMIC_SEQ_CST);
    }
    static inline void ring_pause(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__)
        __asm__ __volatile__("yield");
    #endif
    }
    static inline double ring_now(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    }
    static inline void ring_sleep_on(uint32_t* p, uint32_t seen, double seconds) {
        struct timespec ts;
        if (seconds < 0) seconds = 0;
        ts.tv_sec = (time_t)seconds;
        ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
        syscall(SYS_futex, p, FUTEX_WAIT, seen, &ts, NULL, 0);
    }
    static inline void ring_wake(uint32_t* p) {
        syscall(SYS_futex, p, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
    """
    uint32_t ring_load(uint32_t* p) noexcept nogil
    void ring_store(uint32_t* p, uint32_t v) noexcept nogil
    void ring_add(uint32_t* p, int32_t v) noexcept nogil
    void ring_pause() noexcept nogil
    double ring_now() noexcept nogil
    void ring_sleep_on(uint32_t* p, uint32_t seen, double seconds) noexcept nogil
    void ring_wake(uint32_t* p) noexcept nogil
    int sched_yield() noexcept nogil

#: bytes of a ring's control block and of an entry header; entries are ALIGN-byte aligned
CTRL_BYTES = 128
ENTRY_HEADER = 32
ALIGN = 64
#: entry kinds
PAD, EAGER, CHUNK, CMA = 1, 2, 3, 4
#: wait results
READY, TIME_UP, FAILED = 0, 1, 2

cdef int C_READY = 0, C_TIME_UP = 1, C_FAILED = 2
cdef uint32_t C_PAD = 1, C_CHUNK = 3
cdef double SLICE = 0.05

cdef struct Entry:
    uint32_t kind
    uint32_t len
    uint64_t tag
    uint64_t total
    uint64_t aux


cdef inline uint32_t _entry_bytes(uint32_t payload) noexcept nogil:
    return (32 + payload + 63) & ~(<uint32_t>63)


cdef class Ring:
    """One ring, by the address of its control block (in a mapping the caller keeps alive).

    ``failed_addr`` is the address of this process's u32 failure flag, ``bell_addr`` that of
    the consumer's doorbell; ``spin``/``yields`` bound the busy part of a wait (pauses, then
    ``sched_yield`` calls) before the futex sleep.
    """

    cdef unsigned char* data
    cdef uint32_t* head
    cdef uint32_t* head_sleepers
    cdef uint32_t* tail
    cdef uint32_t* tail_sleepers
    cdef uint32_t* failed
    cdef uint32_t* bell
    cdef readonly uint32_t cap
    cdef uint32_t mask
    cdef int spin, yields

    def __init__(self, size_t ctrl, size_t data, uint32_t cap, size_t failed_addr,
                 size_t bell_addr, int spin=4000, int yields=0):
        if cap < 4 * ALIGN or cap & (cap - 1):
            raise ValueError(f"ring capacity {cap} is not a power of two >= {4 * ALIGN}")
        if ctrl % ALIGN or data % ALIGN:
            raise ValueError(f"ring addresses {ctrl:#x}/{data:#x} are not {ALIGN}-byte aligned")
        self.head = <uint32_t*>ctrl
        self.head_sleepers = <uint32_t*>(ctrl + 4)
        self.tail = <uint32_t*>(ctrl + 64)
        self.tail_sleepers = <uint32_t*>(ctrl + 68)
        self.data = <unsigned char*>data
        self.cap, self.mask = cap, cap - 1
        self.failed = <uint32_t*>failed_addr
        self.bell = <uint32_t*>bell_addr
        self.spin, self.yields = spin, yields

    @property
    def max_payload(self) -> int:
        """The largest payload one entry may carry (a quarter of the ring, less its header)."""
        return self.cap // 4 - ENTRY_HEADER

    # ------------------------------------------------------------------ waiting
    cdef int _wait_change(self, uint32_t* word, uint32_t* sleepers, uint32_t seen,
                          double until, bint watch_failed, bint ring_bell,
                          double busy_until=0.0) noexcept nogil:
        """Wait until ``*word != seen``: READY, TIME_UP at ``until``, FAILED if asked to watch
        the failure flag and it is up. A producer (``ring_bell``) rings the consumer's doorbell
        before each sleep. Until ``busy_until`` the wait keeps spinning (when spinning is on at
        all: the ranks do not outnumber the cores)."""
        cdef int spins = 0, _k
        cdef double now
        while ring_load(word) == seen:
            if spins < self.spin:
                ring_pause()
                spins += 1
                continue
            now = ring_now()
            if now >= until:
                return C_TIME_UP
            if self.spin and now < busy_until:
                for _k in range(64):
                    ring_pause()
                continue
            if watch_failed and ring_load(self.failed) != 0:
                return C_FAILED
            if spins < self.spin + self.yields:
                sched_yield()
                spins += 1
                continue
            ring_add(sleepers, 1)
            if ring_load(word) == seen:
                if ring_bell:
                    ring_add(self.bell, 1)
                    ring_wake(self.bell)
                ring_sleep_on(word, seen, min(SLICE, until - now))
            ring_add(sleepers, -1)
        return C_READY

    def wait_data(self, double until, bint watch_failed=True) -> int:
        """Consumer: wait for an entry (READY), until the monotonic time ``until`` (TIME_UP),
        or for the failure flag (FAILED)."""
        cdef uint32_t t = ring_load(self.tail)
        cdef int rc
        with nogil:
            rc = self._wait_change(self.head, self.head_sleepers, t, until, watch_failed, False)
        return rc

    def wait_consumed(self, uint32_t end, double until, bint watch_failed=True,
                      double busy_until=0.0) -> int:
        """Producer: wait until the consumer's tail has reached position ``end`` (spinning
        until ``busy_until`` first: the time the consumer's copy is expected to take)."""
        cdef uint32_t t
        cdef int rc = C_READY
        with nogil:
            while True:
                t = ring_load(self.tail)
                if <int32_t>(t - end) >= 0:
                    break
                rc = self._wait_change(self.tail, self.tail_sleepers, t, until, watch_failed,
                                       True, busy_until)
                if rc != C_READY:
                    break
        return rc

    def pending(self) -> bool:
        """True if an entry is waiting to be consumed."""
        return ring_load(self.head) != ring_load(self.tail)

    # ------------------------------------------------------------------ producer
    cdef void _publish_head(self, uint32_t pos) noexcept nogil:
        ring_store(self.head, pos)
        if ring_load(self.head_sleepers) != 0:
            ring_wake(self.head)

    cdef int _put_entry(self, uint32_t kind, uint64_t tag, uint64_t total, uint64_t aux,
                        const unsigned char* src, uint32_t n, double until, bint watch_failed,
                        uint32_t* start) noexcept nogil:
        """Append one entry of ``n <= cap/4 - 32`` payload bytes, waiting for space; its ring
        position goes to ``start``."""
        cdef uint32_t need = _entry_bytes(n), pos, room
        cdef int rc = C_READY
        cdef Entry* e
        pos = ring_load(self.head)
        room = self.cap - (pos & self.mask)
        if room < need:  # the entry would wrap: pad the end of the data area
            rc = self._wait_space(pos, room, until, watch_failed)
            if rc != C_READY:
                return rc
            e = <Entry*>(self.data + (pos & self.mask))
            e.kind = C_PAD
            e.len = room - 32
            pos += room
            self._publish_head(pos)
        rc = self._wait_space(pos, need, until, watch_failed)
        if rc != C_READY:
            return rc
        e = <Entry*>(self.data + (pos & self.mask))
        e.kind, e.len, e.tag, e.total, e.aux = kind, n, tag, total, aux
        if n:
            memcpy(self.data + (pos & self.mask) + 32, src, n)
        start[0] = pos
        self._publish_head(pos + need)
        return C_READY

    def put(self, uint32_t kind, uint64_t tag, uint64_t total, uint64_t aux, object payload,
            double until, bint watch_failed=True):
        """Producer: append one entry (``payload`` a buffer of at most :attr:`max_payload`
        bytes, or None), waiting for space. Returns ``(status, start, end)``: READY with the
        entry's ring positions, or TIME_UP/FAILED (nothing written)."""
        cdef Py_buffer buf
        cdef bint have = payload is not None
        cdef uint32_t n = 0, start = 0
        cdef int rc
        if have:
            PyObject_GetBuffer(payload, &buf, PyBUF_SIMPLE)
            if <size_t>buf.len > <size_t>(self.cap // 4 - ENTRY_HEADER):
                PyBuffer_Release(&buf)
                raise ValueError(f"ring entry payload of {buf.len} bytes exceeds "
                                 f"{self.cap // 4 - ENTRY_HEADER}")
            n = <uint32_t>buf.len
        try:
            with nogil:
                rc = self._put_entry(kind, tag, total, aux,
                                     <const unsigned char*>buf.buf if have else NULL, n, until,
                                     watch_failed, &start)
        finally:
            if have:
                PyBuffer_Release(&buf)
        if rc != C_READY:
            return rc, 0, 0
        return rc, start, start + _entry_bytes(n)

    def put_stream(self, uint64_t tag, object payload, size_t offset, uint32_t step,
                   double until, bint watch_failed=True):
        """Producer: stream ``payload[offset:]`` through the ring as CHUNK entries of ``step``
        bytes (at most :attr:`max_payload`; the consumer copies them out meanwhile). Returns
        ``(status, offset reached)``."""
        cdef Py_buffer buf
        cdef uint32_t n, start
        cdef size_t total
        cdef int rc = C_READY
        if step == 0 or step > self.cap // 4 - ENTRY_HEADER:
            raise ValueError(f"ring: chunk size {step} is not in [1, {self.cap // 4 - ENTRY_HEADER}]")
        PyObject_GetBuffer(payload, &buf, PyBUF_SIMPLE)
        total = <size_t>buf.len
        try:
            with nogil:
                while offset < total:
                    n = <uint32_t>min(<size_t>step, total - offset)
                    rc = self._put_entry(C_CHUNK, tag, total, offset,
                                         <const unsigned char*>buf.buf + offset, n, until,
                                         watch_failed, &start)
                    if rc != C_READY:
                        break
                    offset += n
        finally:
            PyBuffer_Release(&buf)
        return rc, offset

    cdef int _wait_space(self, uint32_t pos, uint32_t need, double until,
                         bint watch_failed) noexcept nogil:
        cdef uint32_t t
        cdef int rc
        while True:
            t = ring_load(self.tail)
            if pos + need - t <= self.cap:
                return C_READY
            rc = self._wait_change(self.tail, self.tail_sleepers, t, until, watch_failed, True)
            if rc != C_READY:
                return rc

    def status_at(self, uint32_t start) -> int:
        """Producer: the status the consumer wrote into the (consumed) CMA entry at ``start``
        (the producer still holds its ring lock: nothing has reused the space)."""
        return (<Entry*>(self.data + (start & self.mask))).len

    # ------------------------------------------------------------------ consumer
    cdef Entry* _head_entry(self) noexcept nogil:
        """The entry at tail (skipping padding), or NULL if the ring is empty."""
        cdef uint32_t t = ring_load(self.tail)
        cdef Entry* e
        while t != ring_load(self.head):
            e = <Entry*>(self.data + (t & self.mask))
            if e.kind != C_PAD:
                return e
            t += self.cap - (t & self.mask)
            self._publish_tail(t)
        return NULL

    cdef void _publish_tail(self, uint32_t pos) noexcept nogil:
        ring_store(self.tail, pos)
        if ring_load(self.tail_sleepers) != 0:
            ring_wake(self.tail)

    def peek(self):
        """Consumer: ``(kind, len, tag, total, aux)`` of the next entry, or None."""
        cdef Entry* e = self._head_entry()
        if e == NULL:
            return None
        return e.kind, e.len, e.tag, e.total, e.aux

    def take(self, object out, size_t offset=0):
        """Consumer: copy the next entry's payload into ``out[offset:]`` and consume it."""
        cdef Py_buffer buf
        cdef Entry* e = self._head_entry()
        cdef uint32_t t
        if e == NULL:
            raise RuntimeError("ring: take() on an empty ring")
        PyObject_GetBuffer(out, &buf, PyBUF_WRITABLE)
        try:
            if offset + e.len > <size_t>buf.len:
                raise ValueError(f"ring: a {e.len}-byte payload does not fit at offset {offset} "
                                 f"of a {buf.len}-byte buffer")
            with nogil:
                memcpy(<unsigned char*>buf.buf + offset, <unsigned char*>e + 32, e.len)
                t = ring_load(self.tail)
                self._publish_tail(t + _entry_bytes(e.len))
        finally:
            PyBuffer_Release(&buf)

    def take_stream(self, object out, uint64_t tag, size_t offset, double until,
                    bint watch_failed=True):
        """Consumer: copy the CHUNK entries of the message on ``tag`` that fills ``out`` into
        it, from ``offset`` on, waiting for the producer (which streams them) until ``until``.
        Returns ``(status, offset reached)``; ``offset == len(out)``: the message is complete.
        An entry that is not the next chunk of this message raises RuntimeError."""
        cdef Py_buffer buf
        cdef Entry* e
        cdef size_t total
        cdef uint32_t t
        cdef int rc = C_READY
        cdef bint stray = False
        PyObject_GetBuffer(out, &buf, PyBUF_WRITABLE)
        total = <size_t>buf.len
        try:
            with nogil:
                while offset < total:
                    e = self._head_entry()
                    if e == NULL:
                        rc = self._wait_change(self.head, self.head_sleepers,
                                               ring_load(self.tail), until, watch_failed, False)
                        if rc != C_READY:
                            break
                        continue
                    if (e.kind != C_CHUNK or e.tag != tag or e.aux != offset or e.total != total
                            or offset + e.len > total):
                        stray = True
                        break
                    memcpy(<unsigned char*>buf.buf + offset, <unsigned char*>e + 32, e.len)
                    offset += e.len
                    t = ring_load(self.tail)
                    self._publish_tail(t + _entry_bytes(e.len))
        finally:
            PyBuffer_Release(&buf)
        if stray:
            raise RuntimeError(f"ring: expected chunk at offset {offset} of a {total}-byte "
                               f"message on tag {tag}; the stream is corrupt")
        return rc, offset

    def skip(self, int status=-1):
        """Consumer: consume the next entry without reading its payload; ``status >= 0`` is
        written back into a CMA entry's ``len`` for its producer first."""
        cdef Entry* e = self._head_entry()
        cdef uint32_t t, size
        if e == NULL:
            raise RuntimeError("ring: skip() on an empty ring")
        size = _entry_bytes(e.len)
        if status >= 0:
            e.len = <uint32_t>status
        t = ring_load(self.tail)
        self._publish_tail(t + size)


cdef class Watch:
    """The backstop of a rank's incoming rings: :meth:`wait_stale` sleeps on the rank's
    doorbell without the GIL and, once a producer has rung it (it is about to sleep: its ring
    is full, or it waits for a descriptor to be read), returns the rings whose oldest entry
    nobody consumed for a whole period. The rank's watch thread moves those entries into its
    mailbox, so a receive that is not yet posted never stalls a sender; entries of a receiver
    that is about to take them stay where they are (no extra copy), and an idle rank's watch
    costs nothing."""

    cdef uint32_t** heads
    cdef uint32_t** tails
    cdef uint32_t* seen
    cdef int count
    cdef uint32_t* bell
    cdef uint32_t rung
    cdef uint32_t* stop
    cdef object _keep

    def __init__(self, list ctrls, size_t bell_addr, object stop_word):
        import numpy as np

        cdef size_t base
        cdef Py_ssize_t i, n = len(ctrls)
        self._keep = (np.zeros(max(1, 3 * n), dtype=np.uint64), stop_word)
        base = self._keep[0].ctypes.data
        self.heads = <uint32_t**>base
        self.tails = <uint32_t**>(base + 8 * n)
        self.seen = <uint32_t*>(base + 16 * n)
        self.count = n
        for i in range(n):
            self.heads[i] = <uint32_t*><size_t>ctrls[i]
            self.tails[i] = <uint32_t*>(<size_t>ctrls[i] + 64)
        self.bell = <uint32_t*>bell_addr
        self.rung = ring_load(self.bell)
        self.stop = <uint32_t*><size_t>stop_word.ctypes.data

    def wait_stale(self, double period):
        """Wait for the doorbell, then for a ``period``; returns the indexes of the rings whose
        oldest entry sat there all that period, or None once :meth:`wake` was called."""
        cdef int i
        cdef bint found = False
        cdef uint32_t t
        with nogil:
            while not found and ring_load(self.stop) == 0:
                if ring_load(self.bell) == self.rung:
                    ring_sleep_on(self.bell, self.rung, SLICE)
                    continue
                self.rung = ring_load(self.bell)
                for i in range(self.count):
                    t = ring_load(self.tails[i])
                    self.seen[i] = t if t != ring_load(self.heads[i]) else t ^ 1u
                ring_sleep_on(self.stop, 0, period)
                for i in range(self.count):
                    t = ring_load(self.tails[i])
                    if t == self.seen[i] and t != ring_load(self.heads[i]):
                        found = True
        if not found:
            return None
        return [i for i in range(self.count) if ring_load(self.tails[i]) == self.seen[i]]

    def wake(self):
        """Stop: set the stop word and wake the watcher."""
        ring_store(self.stop, 1)
        ring_wake(self.stop)
        ring_wake(self.bell)
