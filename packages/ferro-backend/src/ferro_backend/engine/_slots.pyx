# cython: language_level=3
"""The engine's collective steps: every rank's slots and step words in the shared segment.

A rank takes part in step ``s`` by writing its slot ``s % 2`` (a collective header, optional
cross-memory addresses and data), then publishing ``step = s`` (release); it waits until every
rank has published ``s`` (acquire). Slot ``s % 2`` is free again at step ``s + 2``: a rank
publishes ``s + 1`` only after reading everyone's step-``s`` slots. :class:`SlotEngine` keeps
this rank's step counter (its users do no step arithmetic); waits are ``_sync.h``'s.

The one-call steps (:meth:`SlotEngine.step_fold`, :meth:`SlotEngine.step_copy`) run a whole
small collective in one call without the GIL: header (with the call's sequence number patched
in) and data into the slot, publish, wait, compare headers, then fold or copy every rank's slot
data straight from the segment. The fold is the collective layer's: it hands its kernel over
once, as a C function pointer in a capsule whose name is the signature (:data:`FOLD_SIGNATURE`,
as scipy's LowLevelCallable does), so the two distributions share no C code and no link.
Validation of what the callers pass (sizes, addresses) is theirs.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy

include "_engine.pxi"

ctypedef int (*fold_fn)(int code, void* out, const void** ptrs, Py_ssize_t count, Py_ssize_t n,
                        int op, double mean_divisor) noexcept nogil

#: the capsule name (the C signature) of the fold :meth:`SlotEngine.set_fold` takes: ``out`` =
#: the rank-order fold of ``count`` inputs of ``n`` items of dtype ``code`` with op ``op``
#: (MEAN's divide fused when ``mean_divisor`` > 0); 0, or -1 for an unknown dtype code
FOLD_SIGNATURE = ("int (int code, void *out, const void **inputs, Py_ssize_t count, "
                  "Py_ssize_t n, int op, double mean_divisor)")
cdef bytes _FOLD_NAME = FOLD_SIGNATURE.encode()
#: step results: the wait ended well, timed out, saw the failure flag, or headers disagree
OK, TIMEOUT, FAILED, MISMATCH = FERRO_OK, FERRO_TIMEOUT, FERRO_FAILED, FERRO_MISMATCH
#: where a collective header holds its 32-bit little-endian sequence number
HEADER_SEQ_OFFSET = 24
cdef size_t SEQ_OFF = 24


cdef class SlotEngine:
    """This rank's collective steps on the mapped ``segment`` (its bytes: holding them keeps
    the mapping alive), with the wait ``spin``/``yields`` policy and this process's failure
    flag (a u32 at ``failed_addr``)."""

    cdef unsigned char* base
    cdef object _keep
    cdef ferro_layout L
    cdef readonly int n, me
    cdef readonly uint32_t step
    cdef readonly unsigned long long sent
    cdef ferro_policy pol
    cdef uint32_t* failed
    cdef size_t hlen
    cdef fold_fn fold_kernel

    def __init__(self, unsigned char[::1] segment, int nranks, int rank, size_t slot_bytes,
                 size_t ring_bytes, size_t failed_addr, int spin, int yields):
        ferro_layout_init(&self.L, nranks, slot_bytes, ring_bytes)
        if <size_t>segment.shape[0] < self.L.size or not 0 <= rank < nranks:
            raise ValueError(f"SlotEngine: rank {rank} of {nranks} on {segment.shape[0]} bytes "
                             f"(the layout needs {self.L.size})")
        self.base, self._keep = &segment[0], segment
        self.n, self.me = nranks, rank
        self.pol.spin, self.pol.yields = spin, yields
        self.failed = <uint32_t*>failed_addr

    @property
    def slot_bytes(self) -> int:
        return self.L.slot_bytes

    def set_fold(self, capsule):
        """Take the fold kernel the one-call reductions use: a capsule named
        :data:`FOLD_SIGNATURE` holding the function's address."""
        if not PyCapsule_IsValid(capsule, _FOLD_NAME):
            raise TypeError(f"SlotEngine.set_fold: expected a capsule named {FOLD_SIGNATURE!r}, "
                            f"got {capsule!r}")
        self.fold_kernel = <fold_fn>PyCapsule_GetPointer(capsule, _FOLD_NAME)

    # ------------------------------------------------------------------ protocol
    cdef inline ferro_slot_head* _slot(self, int rank, uint32_t step) noexcept nogil:
        return ferro_slot_of(self.base, &self.L, rank, step)

    cdef void _publish(self, uint32_t step) noexcept nogil:
        cdef ferro_ctrl* c = ferro_ctrl_of(self.base, &self.L, self.me)
        ferro_publish(&c.step, step, &c.sleepers)

    cdef int _wait_all(self, uint32_t step, double deadline) noexcept nogil:
        cdef int j, rc
        cdef ferro_ctrl* c
        for j in range(self.n):
            if j != self.me:
                c = ferro_ctrl_of(self.base, &self.L, j)
                rc = ferro_wait(&self.pol, &c.step, step, FERRO_UNTIL_REACHED, &c.sleepers,
                                deadline, self.failed, NULL, 0.0)
                if rc != FERRO_OK:
                    return rc
        return FERRO_OK

    cdef int _exchange(self, const unsigned char* header, size_t hlen, bint patch,
                       uint32_t seq, const unsigned char* src, size_t nbytes,
                       double deadline) noexcept nogil:
        """The next step: header (``seq`` written at SEQ_OFF when ``patch``) and ``nbytes``
        at ``src`` into this rank's slot, publish, wait for every rank, compare headers."""
        cdef uint32_t step = self.step + 1
        cdef ferro_slot_head* mine = self._slot(self.me, step)
        cdef int rc
        memcpy(mine.header, header, hlen)
        if patch:
            mine.header[SEQ_OFF] = seq & 0xFF
            mine.header[SEQ_OFF + 1] = (seq >> 8) & 0xFF
            mine.header[SEQ_OFF + 2] = (seq >> 16) & 0xFF
            mine.header[SEQ_OFF + 3] = (seq >> 24) & 0xFF
        if nbytes:
            memcpy(ferro_slot_data(mine), src, nbytes)
        self.step, self.hlen = step, hlen
        self.sent += nbytes
        self._publish(step)
        rc = self._wait_all(step, deadline)
        if rc == FERRO_OK and not self._agree():
            return FERRO_MISMATCH
        return rc

    cdef bint _agree(self) noexcept nogil:
        """Whether every rank's header of this step equals this rank's."""
        cdef int j
        cdef ferro_slot_head* mine = self._slot(self.me, self.step)
        for j in range(self.n):
            if memcmp(self._slot(j, self.step).header, mine.header, self.hlen) != 0:
                return False
        return True

    def exchange(self, bytes header not None, object src, size_t prefilled, object extra,
                 double deadline):
        """The next step: ``header``, this rank's cross-memory addresses ``extra`` (``(pid,
        input address, output address)`` or None) and the bytes of ``src`` (a C-contiguous
        buffer of at most a slot, or None; ``prefilled``: bytes already written into
        :meth:`data` for this step) into this rank's slot; publish and wait (until
        ``deadline``, a ``time.monotonic()`` value) for every rank; compare the headers.
        Returns OK, TIMEOUT, FAILED or MISMATCH."""
        cdef Py_buffer s
        cdef int rc
        cdef const unsigned char* h = header
        cdef size_t hlen = len(header)
        cdef ferro_slot_head* mine = self._slot(self.me, self.step + 1)
        cdef bint have = src is not None
        if hlen > FERRO_HEADER_ROOM:
            raise ValueError(f"exchange: a {hlen}-byte header exceeds {FERRO_HEADER_ROOM}")
        if extra is not None:
            mine.pid, mine.in_addr, mine.out_addr = extra
        if have:
            PyObject_GetBuffer(src, &s, PyBUF_SIMPLE)
        try:
            if have and <size_t>s.len > self.L.slot_bytes:
                raise ValueError(f"exchange: {s.len} bytes exceed the slot ({self.L.slot_bytes})")
            with nogil:
                rc = self._exchange(h, hlen, False, 0, <const unsigned char*>s.buf if have
                                    else NULL, <size_t>s.len if have else 0, deadline)
            self.sent += prefilled
        finally:
            if have:
                PyBuffer_Release(&s)
        return rc

    def step_barrier(self, bytes header not None, uint32_t seq, double deadline):
        """A step with no data (the barrier): ``header`` with ``seq`` patched in; OK,
        TIMEOUT, FAILED or MISMATCH."""
        cdef int rc
        cdef const unsigned char* h = header
        cdef Py_ssize_t hlen = len(header)
        with nogil:
            rc = self._exchange(h, hlen, True, seq, NULL, 0, deadline)
        return rc

    def sync(self, double deadline):
        """A step without slot writes: nobody goes on before everyone has finished the last
        one. OK, TIMEOUT or FAILED."""
        cdef int rc
        with nogil:
            self.step += 1
            self._publish(self.step)
            rc = self._wait_all(self.step, deadline)
        return rc

    def wait(self, double deadline):
        """Wait (again) for every rank to reach this rank's step; OK, TIMEOUT or FAILED."""
        cdef int rc
        with nogil:
            rc = self._wait_all(self.step, deadline)
        return rc

    def withdraw(self):
        """Publish the step before this one: a rank that gives up on a step must not look
        arrived to a peer still reading its buffers."""
        self._publish(self.step - 1)

    def headers_agree(self) -> bool:
        """Whether every rank's header of this step equals this rank's."""
        return self._agree()

    def headers(self) -> list:
        """Every rank's header of this step (this step's header length each)."""
        return [bytes(self._slot(j, self.step).header[:self.hlen]) for j in range(self.n)]

    def extras(self) -> list:
        """Every rank's ``(pid, input address, output address)`` of this step."""
        return [(self._slot(j, self.step).pid, self._slot(j, self.step).in_addr,
                 self._slot(j, self.step).out_addr) for j in range(self.n)]

    def missing(self) -> list:
        """The ranks that have not published this rank's step yet (for error messages)."""
        return [j for j in range(self.n) if j != self.me and
                <int32_t>(ferro_load(&ferro_ctrl_of(self.base, &self.L, j).step) - self.step) < 0]

    def published(self, int rank) -> int:
        """The last step ``rank`` published."""
        return ferro_load(&ferro_ctrl_of(self.base, &self.L, rank).step)

    # ------------------------------------------------------------------ one-call steps
    def step_fold(self, bytes header not None, uint32_t seq, object src, object out,
                  size_t offset, Py_ssize_t count, size_t itemsize, int code, int op,
                  double mean_divisor, double deadline):
        """A whole reduction step: ``header`` with ``seq`` patched in and the bytes of ``src``
        (C-contiguous) through the slots; then, when every rank arrived with the same header,
        ``out``'s first ``count`` items (``itemsize`` bytes, dtype ``code``) become the
        rank-order fold of every rank's slot data from byte ``offset``. OK, TIMEOUT, FAILED or
        MISMATCH (``out`` untouched unless OK: :meth:`fold` finishes a step whose wait ended
        later)."""
        cdef Py_buffer s, o
        cdef int rc
        cdef const unsigned char* h = header
        cdef Py_ssize_t hlen = len(header)
        self._buffers(src, out, &s, &o)
        try:
            self._check_fold(s.len, o.len, offset, count, itemsize)
            with nogil:
                rc = self._exchange(h, hlen, True, seq, <const unsigned char*>s.buf, s.len,
                                    deadline)
                if rc == FERRO_OK and count > 0:
                    rc = self._fold_slots(<unsigned char*>o.buf, offset, count, code, op,
                                          mean_divisor)
        finally:
            PyBuffer_Release(&s)
            PyBuffer_Release(&o)
        if rc == -1:
            raise ValueError(f"fold: unknown dtype code {code} (or no memory)")
        return rc

    def fold(self, object out, size_t nbytes, size_t offset, Py_ssize_t count,
             size_t itemsize, int code, int op, double mean_divisor):
        """:meth:`step_fold`'s fold alone, on this step's slot data of ``nbytes``."""
        cdef Py_buffer o
        cdef int rc
        PyObject_GetBuffer(out, &o, PyBUF_WRITABLE)
        try:
            self._check_fold(nbytes, o.len, offset, count, itemsize)
            with nogil:
                rc = self._fold_slots(<unsigned char*>o.buf, offset, count, code, op,
                                      mean_divisor)
        finally:
            PyBuffer_Release(&o)
        if rc != 0:
            raise ValueError(f"fold: unknown dtype code {code} (or no memory)")

    cdef int _fold_slots(self, unsigned char* out, size_t offset, Py_ssize_t count, int code,
                         int op, double mean_divisor) noexcept nogil:
        cdef const void* few[64]
        cdef const void** ptrs = few
        cdef int j, rc
        if self.n > 64:
            ptrs = <const void**>malloc(self.n * sizeof(void*))
            if ptrs == NULL:
                return -1
        for j in range(self.n):
            ptrs[j] = ferro_slot_data(self._slot(j, self.step)) + offset
        rc = self.fold_kernel(code, out, ptrs, self.n, count, op, mean_divisor)
        if ptrs != few:
            free(ptrs)
        return rc

    cdef int _check_fold(self, Py_ssize_t nbytes, Py_ssize_t out_len, size_t offset,
                         Py_ssize_t count, size_t itemsize) except -1:
        if self.fold_kernel == NULL:
            raise RuntimeError("SlotEngine: no fold kernel (set_fold was never called)")
        if (count < 0 or <size_t>nbytes > self.L.slot_bytes
                or offset + count * itemsize > <size_t>nbytes
                or count * itemsize > <size_t>out_len):
            raise ValueError(f"fold: {count} items at offset {offset} of {nbytes} bytes of slot "
                             f"data (slot {self.L.slot_bytes}), output of {out_len} bytes")
        return 0

    cdef int _buffers(self, object src, object out, Py_buffer* s, Py_buffer* o) except -1:
        PyObject_GetBuffer(src, s, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(out, o, PyBUF_WRITABLE)
        except BaseException:
            PyBuffer_Release(s)
            raise
        return 0

    def step_copy(self, bytes header not None, uint32_t seq, object src, object out, int root,
                  double deadline):
        """A whole broadcast (``root`` >= 0: every rank copies ``len(src)`` bytes from
        ``root``'s slot into ``out``; only the root sends data) or all_gather (``root`` = -1:
        block ``r`` of ``out`` comes from rank ``r``'s slot, this rank's own from ``src``)
        step; OK, TIMEOUT, FAILED or MISMATCH (nothing copied unless OK: :meth:`copy`)."""
        cdef Py_buffer s, o
        cdef int rc
        cdef const unsigned char* h = header
        cdef Py_ssize_t hlen = len(header)
        self._buffers(src, out, &s, &o)
        try:
            self._check_copy(s.len, o.len, root)
            with nogil:
                rc = self._exchange(h, hlen, True, seq, <const unsigned char*>s.buf,
                                    s.len if root < 0 or root == self.me else 0, deadline)
                if rc == FERRO_OK:
                    self._copy_slots(<unsigned char*>o.buf, <const unsigned char*>s.buf,
                                     s.len, root)
        finally:
            PyBuffer_Release(&s)
            PyBuffer_Release(&o)
        return rc

    def copy(self, object src, object out, int root):
        """The copies of :meth:`step_copy` alone, for a step whose wait ended later."""
        cdef Py_buffer s, o
        self._buffers(src, out, &s, &o)
        try:
            self._check_copy(s.len, o.len, root)
            with nogil:
                self._copy_slots(<unsigned char*>o.buf, <const unsigned char*>s.buf, s.len, root)
        finally:
            PyBuffer_Release(&s)
            PyBuffer_Release(&o)

    cdef int _check_copy(self, Py_ssize_t nbytes, Py_ssize_t out_len, int root) except -1:
        if root >= self.n or root < -1:
            raise ValueError(f"copy: root {root} is not a rank of {self.n} (or -1)")
        cdef Py_ssize_t want = nbytes if root >= 0 else nbytes * self.n
        if <size_t>nbytes > self.L.slot_bytes or out_len != want:
            raise ValueError(f"copy: {nbytes} bytes per rank (slot {self.L.slot_bytes}) do not "
                             f"fill an output of {out_len} bytes")
        return 0

    cdef void _copy_slots(self, unsigned char* out, const unsigned char* src, size_t nbytes,
                          int root) noexcept nogil:
        cdef int j
        if root >= 0:
            if root != self.me:
                memcpy(out, ferro_slot_data(self._slot(root, self.step)), nbytes)
            elif <const unsigned char*>out != src:
                memcpy(out, src, nbytes)
            return
        for j in range(self.n):
            if j != self.me:
                memcpy(out + j * nbytes, ferro_slot_data(self._slot(j, self.step)), nbytes)
            elif <const unsigned char*>(out + j * nbytes) != src:
                memcpy(out + j * nbytes, src, nbytes)
