# cython: language_level=3
"""The engine's point-to-point rings: one single-producer, single-consumer byte ring per ordered
pair of ranks in the shared segment (``_layout.h``: ``ferro_ring_ctrl`` and its entries).

An entry is a 32-byte ``ferro_ring_entry`` header and its payload, 64-byte aligned; an entry
never wraps: a PAD entry fills the end of the data area instead. The producer (under its
process's per-ring lock) waits for space, writes the entry and publishes ``head``; the consumer
(under its per-ring lock) reads the entry at ``tail`` and publishes the new ``tail``. Waits are
``_sync.h``'s, without the GIL; a producer about to sleep first rings the consumer's doorbell,
so that the consumer's :class:`Watch` drains a ring nobody else is draining. Framing of
messages (eager, chunked, by cross-memory descriptor) and matching are ``rings.py``'s.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.string cimport memcpy

include "_engine.pxi"

#: bytes of an entry header; entries are ALIGN-byte aligned
ENTRY_HEADER = sizeof(ferro_ring_entry)
ALIGN = 64
#: entry kinds
PAD, EAGER, CHUNK, CMA = FERRO_PAD, FERRO_EAGER, FERRO_CHUNK, FERRO_CMA
#: wait results
READY, TIME_UP, FAILED = FERRO_OK, FERRO_TIMEOUT, FERRO_FAILED


cdef extern from "_ringio.h" nogil:
    ctypedef struct ferro_ring_io:
        ferro_ring_ctrl* ctrl
        unsigned char* data
        uint32_t cap
    uint32_t ferro_entry_bytes(uint32_t n)
    void ferro_ring_io_init(ferro_ring_io* io, ferro_ring_ctrl* ctrl, uint32_t cap,
                            uint32_t* bell, uint32_t* failed, int spin, int yields)
    int ferro_ring_wait(ferro_ring_io* io, int on_tail, uint32_t seen, double until,
                        int watch_failed, double busy_until)
    void ferro_ring_publish_tail(ferro_ring_io* io, uint32_t pos)
    int ferro_ring_put(ferro_ring_io* io, uint32_t kind, uint64_t tag, uint64_t total,
                       uint64_t aux, const unsigned char* src, uint32_t n, double until,
                       int watch_failed, uint32_t* start)
    ferro_ring_entry* ferro_ring_head(ferro_ring_io* io)
    int ferro_ring_published(ferro_ring_io* io, const ferro_ring_entry* e)
    void ferro_ring_consume(ferro_ring_io* io, const ferro_ring_entry* e)


cdef class Ring:
    """The ring from ``src`` to ``dst`` of the mapped ``segment`` (its bytes: holding them keeps
    the mapping alive), with this process's failure flag at ``failed_addr`` and the wait policy
    ``spin``/``yields``. The moves are ``_ringio.h``'s."""

    cdef ferro_ring_io io
    cdef readonly uint32_t cap
    cdef object _keep

    def __init__(self, unsigned char[::1] segment, int nranks, size_t slot_bytes,
                 size_t ring_bytes, int src, int dst, size_t failed_addr, int spin=4000,
                 int yields=0):
        cdef ferro_layout L
        cdef unsigned char* base = &segment[0]
        if ring_bytes < 4 * ALIGN or ring_bytes & (ring_bytes - 1) or ring_bytes >> 31:
            raise ValueError(f"ring capacity {ring_bytes} is not a power of two in "
                             f"[{4 * ALIGN}, 2**31)")
        if not (0 <= src < nranks and 0 <= dst < nranks):
            raise ValueError(f"ring {src} -> {dst} is not a pair of {nranks} ranks")
        ferro_layout_init(&L, nranks, slot_bytes, ring_bytes)
        if <size_t>segment.shape[0] < L.size:
            raise ValueError(f"Ring: {segment.shape[0]} bytes, the layout needs {L.size}")
        self._keep = segment
        self.cap = <uint32_t>ring_bytes
        ferro_ring_io_init(&self.io, ferro_ring_of(base, &L, src, dst), self.cap,
                           &ferro_ctrl_of(base, &L, dst).bell, <uint32_t*>failed_addr, spin,
                           yields)

    @property
    def max_payload(self) -> int:
        """The largest payload one entry may carry (a quarter of the ring, less its header)."""
        return self.cap // 4 - ENTRY_HEADER

    @property
    def control_address(self) -> int:
        """The address of this ring's control block (for :class:`Watch`)."""
        return <size_t>self.io.ctrl

    # ------------------------------------------------------------------ waiting
    def wait_data(self, double until, bint watch_failed=True) -> int:
        """Consumer: wait for an entry (READY), until the monotonic time ``until`` (TIME_UP),
        or for the failure flag (FAILED)."""
        cdef int rc
        with nogil:
            rc = ferro_ring_wait(&self.io, 0, ferro_load(&self.io.ctrl.tail), until,
                                 watch_failed, 0.0)
        return rc

    def wait_consumed(self, uint32_t end, double until, bint watch_failed=True,
                      double busy_until=0.0) -> int:
        """Producer: wait until the consumer's tail has reached position ``end`` (spinning
        until ``busy_until`` first: the time the consumer's copy is expected to take)."""
        cdef uint32_t t
        cdef int rc = FERRO_OK
        with nogil:
            while True:
                t = ferro_load(&self.io.ctrl.tail)
                if <int32_t>(t - end) >= 0:
                    break
                rc = ferro_ring_wait(&self.io, 1, t, until, watch_failed, busy_until)
                if rc != FERRO_OK:
                    break
        return rc

    def pending(self) -> bool:
        """True if an entry is waiting to be consumed."""
        return ferro_load(&self.io.ctrl.head) != ferro_load(&self.io.ctrl.tail)

    # ------------------------------------------------------------------ producer
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
                rc = ferro_ring_put(&self.io, kind, tag, total, aux,
                                    <const unsigned char*>buf.buf if have else NULL, n, until,
                                    watch_failed, &start)
        finally:
            if have:
                PyBuffer_Release(&buf)
        if rc != FERRO_OK:
            return rc, 0, 0
        return rc, start, start + ferro_entry_bytes(n)

    def put_stream(self, uint64_t tag, object payload, size_t offset, uint32_t step,
                   double until, bint watch_failed=True):
        """Producer: stream ``payload[offset:]`` through the ring as CHUNK entries of ``step``
        bytes (at most :attr:`max_payload`; the consumer copies them out meanwhile). Returns
        ``(status, offset reached)``."""
        cdef Py_buffer buf
        cdef uint32_t n, start
        cdef size_t total
        cdef int rc = FERRO_OK
        if step == 0 or step > self.cap // 4 - ENTRY_HEADER:
            raise ValueError(f"ring: chunk size {step} is not in [1, {self.cap // 4 - ENTRY_HEADER}]")
        PyObject_GetBuffer(payload, &buf, PyBUF_SIMPLE)
        total = <size_t>buf.len
        try:
            with nogil:
                while offset < total:
                    n = <uint32_t>min(<size_t>step, total - offset)
                    rc = ferro_ring_put(&self.io, FERRO_CHUNK, tag, total, offset,
                                        <const unsigned char*>buf.buf + offset, n, until,
                                        watch_failed, &start)
                    if rc != FERRO_OK:
                        break
                    offset += n
        finally:
            PyBuffer_Release(&buf)
        return rc, offset

    def status_at(self, uint32_t start) -> int:
        """Producer: the status the consumer wrote into the (consumed) CMA entry at ``start``
        (the producer still holds its ring lock: nothing has reused the space)."""
        return (<ferro_ring_entry*>(self.io.data + (start & (self.cap - 1)))).len

    # ------------------------------------------------------------------ consumer
    def peek(self):
        """Consumer: ``(kind, len, tag, total, aux)`` of the next entry, or None."""
        cdef ferro_ring_entry* e = ferro_ring_head(&self.io)
        if e == NULL:
            return None
        return e.kind, e.len, e.tag, e.total, e.aux

    def take(self, object out, size_t offset=0):
        """Consumer: copy the next entry's payload into ``out[offset:]`` and consume it."""
        cdef Py_buffer buf
        cdef ferro_ring_entry* e = ferro_ring_head(&self.io)
        if e == NULL:
            raise RuntimeError("ring: take() on an empty ring")
        PyObject_GetBuffer(out, &buf, PyBUF_WRITABLE)
        try:
            if offset + e.len > <size_t>buf.len:
                raise ValueError(f"ring: a {e.len}-byte payload does not fit at offset {offset} "
                                 f"of a {buf.len}-byte buffer")
            with nogil:
                memcpy(<unsigned char*>buf.buf + offset, <unsigned char*>e + 32, e.len)
                ferro_ring_consume(&self.io, e)
        finally:
            PyBuffer_Release(&buf)

    def take_stream(self, object out, uint64_t tag, size_t offset, double until,
                    bint watch_failed=True):
        """Consumer: copy the CHUNK entries of the message on ``tag`` that fills ``out`` into
        it, from ``offset`` on, waiting for the producer (which streams them) until ``until``.
        Returns ``(status, offset reached)``; ``offset == len(out)``: the message is complete.
        An entry that is not the next chunk of this message raises RuntimeError."""
        cdef Py_buffer buf
        cdef ferro_ring_entry* e
        cdef size_t total
        cdef int rc = FERRO_OK
        cdef bint stray = False
        PyObject_GetBuffer(out, &buf, PyBUF_WRITABLE)
        total = <size_t>buf.len
        try:
            with nogil:
                while offset < total:
                    e = ferro_ring_head(&self.io)
                    if e == NULL:
                        rc = ferro_ring_wait(&self.io, 0, ferro_load(&self.io.ctrl.tail), until,
                                             watch_failed, 0.0)
                        if rc != FERRO_OK:
                            break
                        continue
                    if (e.kind != FERRO_CHUNK or e.tag != tag or e.aux != offset
                            or e.total != total or offset + e.len > total
                            or not ferro_ring_published(&self.io, e)):
                        stray = True
                        break
                    memcpy(<unsigned char*>buf.buf + offset, <unsigned char*>e + 32, e.len)
                    offset += e.len
                    ferro_ring_consume(&self.io, e)
        finally:
            PyBuffer_Release(&buf)
        if stray:
            raise RuntimeError(f"ring: expected chunk at offset {offset} of a {total}-byte "
                               f"message on tag {tag}; the stream is corrupt")
        return rc, offset

    def skip(self, int status=-1):
        """Consumer: consume the next entry without reading its payload; ``status >= 0`` is
        written back into a CMA entry's ``len`` for its producer first."""
        cdef ferro_ring_entry* e = ferro_ring_head(&self.io)
        cdef uint32_t size
        if e == NULL:
            raise RuntimeError("ring: skip() on an empty ring")
        size = ferro_entry_bytes(e.len)
        if status >= 0:
            e.len = <uint32_t>status
        ferro_ring_publish_tail(&self.io, ferro_load(&self.io.ctrl.tail) + size)
