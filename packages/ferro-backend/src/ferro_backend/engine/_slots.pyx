# cython: language_level=3
"""The engine's collective steps: every rank's slots and step words in the shared segment.

A rank takes part in step ``s`` by writing its slot ``s % 2`` (a collective header, optional
cross-memory addresses and data), then publishing ``step = s`` (release); it waits until every
rank has published ``s`` (acquire). The protocol is C, in ``_steps.h`` (waits: ``_sync.h``);
:class:`SlotEngine` keeps this rank's step counter and offers the steps to Python.

The one-call steps (``step_allreduce``, ``step_gather``, ``step_barrier``) run a whole
collective without the GIL; other extensions call them with no Python in between through
:meth:`SlotEngine.api` (a table of function pointers in a capsule named :data:`API_SIGNATURE`). The fold is the collective layer's, handed over once as a C
function pointer in a capsule named by its signature (:data:`FOLD_SIGNATURE`, as scipy's
LowLevelCallable): the two distributions share no C code and no link. Callers validate sizes.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New
from libc.stdlib cimport calloc, free

include "_engine.pxi"
include "_steps.pxi"

#: step results: the wait ended well, timed out, saw the failure flag, or headers disagree
OK, TIMEOUT, FAILED, MISMATCH = FERRO_OK, FERRO_TIMEOUT, FERRO_FAILED, FERRO_MISMATCH
#: where a collective header holds its 32-bit little-endian sequence number
HEADER_SEQ_OFFSET = FERRO_SEQ_OFF


def header_hash(const unsigned char[::1] header) -> int:
    """The hash a rank publishes with a step's ``header``, without its sequence number (what
    the :meth:`SlotEngine.api` steps take, computed once per call signature)."""
    return ferro_header_hash(&header[0] if header.shape[0] else NULL, header.shape[0])


cdef class SlotEngine:
    """This rank's collective steps on the mapped ``segment`` (its bytes: holding them keeps
    the mapping alive), with the wait ``spin``/``yields`` policy and this process's failure
    flag (a u32 at ``failed_addr``)."""

    cdef ferro_slots s
    cdef ferro_slots_api table
    cdef object _keep

    def __init__(self, unsigned char[::1] segment, int nranks, int rank, size_t slot_bytes,
                 size_t ring_bytes, size_t failed_addr, int spin, int yields):
        ferro_layout_init(&self.s.L, nranks, slot_bytes, ring_bytes)
        if <size_t>segment.shape[0] < self.s.L.size or not 0 <= rank < nranks:
            raise ValueError(f"SlotEngine: rank {rank} of {nranks} on {segment.shape[0]} bytes "
                             f"(the layout needs {self.s.L.size})")
        self.s.base, self._keep = &segment[0], segment
        self.s.n, self.s.me = nranks, rank
        self.s.pol.spin, self.s.pol.yields = spin, yields
        self.s.failed = <uint32_t*>failed_addr
        self.s.split.bases = <uint32_t*>calloc(3 * nranks, sizeof(uint32_t))
        self.s.split.scratch = <unsigned char*>calloc(FERRO_SPLIT_CHUNK_MAX + 256, 1)
        if self.s.split.bases == NULL or self.s.split.scratch == NULL:
            raise MemoryError()
        ferro_slots_api_init(&self.table, &self.s)

    def __dealloc__(self):
        free(self.s.split.bases)
        free(self.s.split.scratch)

    @property
    def n(self) -> int:
        return self.s.n

    @property
    def me(self) -> int:
        return self.s.me

    @property
    def step(self) -> int:
        return self.s.step

    @property
    def sent(self) -> int:
        return self.s.sent

    def timed_waits(self, bint on) -> float:
        """Time the steps' waits for peers (``on``) or not; the seconds waited while timed."""
        self.s.clock = on
        return self.s.waited

    @property
    def slot_bytes(self) -> int:
        return self.s.L.slot_bytes

    @property
    def split_bytes(self) -> int:
        """One-call allreduces of at least this many bytes (within a slot) run split: each
        rank folds one part, pipelined in chunks (``_split.h``); 0: never."""
        return self.s.split_min

    @split_bytes.setter
    def split_bytes(self, size_t value):
        self.s.split_min = value

    def set_put(self, size_t small_bytes, double slow_factor):
        """Calls of at most ``small_bytes`` whose data stays put copy into shared memory with
        non-temporal stores, others while plain copies run ``slow_factor`` times slower than
        between private buffers (``_put.h``); returns that rate (ns per KiB)."""
        self.s.put.small_bytes = small_bytes
        self.s.put.slow_ns = slow_factor * ferro_copy_ns_per_kib(ferro_now)
        return self.s.put.slow_ns

    def set_fold(self, capsule):
        """Take the fold kernel the one-call reductions use: a capsule named
        :data:`FOLD_SIGNATURE` holding the function's address."""
        if not PyCapsule_IsValid(capsule, _FOLD_NAME):
            raise TypeError(f"SlotEngine.set_fold: expected a capsule named {FOLD_SIGNATURE!r}, "
                            f"got {capsule!r}")
        self.s.fold = <ferro_fold_fn>PyCapsule_GetPointer(capsule, _FOLD_NAME)

    def api(self):
        """The one-call steps as a capsule named :data:`API_SIGNATURE` (valid while this
        SlotEngine lives: its holder keeps a reference to it)."""
        return PyCapsule_New(&self.table, _API_NAME, NULL)

    # ------------------------------------------------------------------ steps
    def exchange(self, bytes header not None, object src, size_t prefilled, object extra,
                 double deadline, size_t span=0):
        """The next step: ``header``, this rank's cross-memory addresses ``extra`` (``(pid,
        input address, output address)`` or None) and the bytes of ``src`` (C-contiguous, at
        most a slot, or None; ``prefilled``: bytes already written for this step) into this
        rank's slot, at :meth:`rot` of ``span``; publish, wait (until ``deadline``, a
        ``time.monotonic()`` value) for every rank, compare the headers: OK, TIMEOUT, FAILED or
        MISMATCH."""
        cdef Py_buffer b
        cdef int rc
        cdef const unsigned char* h = header
        cdef size_t hlen = len(header)
        cdef ferro_slot_head* mine = ferro_slots_slot(&self.s, self.s.me, self.s.step + 1)
        cdef bint have = src is not None
        if hlen > FERRO_HEADER_ROOM:
            raise ValueError(f"exchange: a {hlen}-byte header exceeds {FERRO_HEADER_ROOM}")
        if extra is not None:
            mine.pid, mine.in_addr, mine.out_addr = extra
        if have:
            PyObject_GetBuffer(src, &b, PyBUF_SIMPLE)
        try:
            if have and <size_t>b.len > self.s.L.slot_bytes:
                raise ValueError(f"exchange: {b.len} bytes exceed the slot "
                                 f"({self.s.L.slot_bytes})")
            with nogil:
                rc = ferro_slots_exchange(&self.s, h, hlen, 0, 0, 0,
                                          <const unsigned char*>b.buf if have else NULL,
                                          <size_t>b.len if have else 0, span, deadline)
            self.s.sent += prefilled
        finally:
            if have:
                PyBuffer_Release(&b)
        return rc

    def step_barrier(self, bytes header not None, uint32_t seq, double deadline):
        """A step with no data (``header``, ``seq`` patched in): OK, TIMEOUT, FAILED, MISMATCH."""
        cdef int rc
        cdef const unsigned char* h = header
        cdef size_t hlen = self._header_len(header)
        cdef uint64_t hash = ferro_header_hash(h, hlen)
        with nogil:
            rc = ferro_slots_exchange(&self.s, h, hlen, 1, hash, seq, NULL, 0, 0, deadline)
        return rc

    def rot(self, uint32_t step, size_t span) -> int:
        """Where ``step``'s data starts in each slot, ``span`` bytes per rank (_onestep.h)."""
        return ferro_slots_rot(&self.s, step, span)

    def sync(self, double deadline):
        """A step without slot writes (all finished the last one): OK, TIMEOUT or FAILED."""
        cdef int rc
        with nogil:
            rc = ferro_slots_sync(&self.s, deadline)
        return rc

    def wait(self, double deadline):
        """Wait (again) for every rank to reach this rank's step; OK, TIMEOUT or FAILED."""
        cdef int rc
        with nogil:
            rc = ferro_slots_wait_all(&self.s, self.s.step, deadline)
        return rc

    def withdraw(self):
        """Publish the step before this one (who gives up on a step must not look arrived)."""
        ferro_slots_publish(&self.s, self.s.step - 1)

    def headers_agree(self) -> bool:
        """Whether every rank's header of this step equals this rank's."""
        return ferro_slots_agree(&self.s) != 0

    def headers(self) -> list:
        """Every rank's header of this step (this step's header length each)."""
        return [bytes(ferro_slots_slot(&self.s, j, self.s.step).header[:self.s.hlen])
                for j in range(self.s.n)]

    def extras(self) -> list:
        """Every rank's ``(pid, input address, output address)`` of this step."""
        cdef ferro_slot_head* h
        out = []
        for j in range(self.s.n):
            h = ferro_slots_slot(&self.s, j, self.s.step)
            out.append((h.pid, h.in_addr, h.out_addr))
        return out

    def missing(self) -> list:
        """The ranks that have not published this rank's step yet (for error messages)."""
        return [j for j in range(self.s.n) if j != self.s.me and
                <int32_t>(ferro_load(&ferro_ctrl_of(self.s.base, &self.s.L, j).step)
                          - self.s.step) < 0]

    def published(self, int rank) -> int:
        """The last step ``rank`` published."""
        return ferro_load(&ferro_ctrl_of(self.s.base, &self.s.L, rank).step)

    cdef size_t _header_len(self, bytes header) except? 0:
        if <size_t>len(header) > FERRO_HEADER_ROOM:
            raise ValueError(f"a {len(header)}-byte header exceeds {FERRO_HEADER_ROOM}")
        return len(header)

    # ------------------------------------------------------------------ one-call steps
    def split_fits(self, size_t nbytes, Py_ssize_t count) -> bool:
        """Whether :meth:`step_allreduce` splits ``count`` items in ``nbytes`` beyond a slot
        (:attr:`split_bytes` > 0, and ``ferro_split_can``); the same on every rank."""
        return self.s.split_min > 0 and ferro_split_can(&self.s, nbytes, count)

    def step_allreduce(self, bytes header not None, uint32_t seq, object src, object out,
                       Py_ssize_t count, int code, int op, double mean_divisor,
                       double deadline, bint scatter=False):
        """A whole allreduce of ``count`` items (dtype ``code``) as the compiled path runs it
        (split from :attr:`split_bytes`, else one step; beyond a slot split through rings:
        :meth:`split_fits`), whichever layer calls. ``scatter``: a reduce_scatter, always split
        (``out``: this rank's ``count / n`` items). OK, TIMEOUT, FAILED or MISMATCH (``out`` is
        complete only when OK: :meth:`resume` or :meth:`fold` finishes a late step)."""
        cdef Py_buffer b, o
        cdef int rc
        cdef const unsigned char* h = header
        cdef size_t hlen = self._header_len(header)
        self._buffers(src, out, &b, &o)
        try:
            if scatter or <size_t>b.len > self.s.L.slot_bytes:
                self._check_split(b.len, o.len, count, scatter)
                with nogil:
                    rc = ferro_split_start(&self.s, h, hlen, ferro_header_hash(h, hlen), seq,
                                           b.buf, b.len, o.buf, count, code, op, mean_divisor,
                                           not scatter, deadline)
            else:
                self._check_fold(b.len, o.len, 0, count, b.len // count if count else 1)
                rc = self.table.allreduce(&self.s, h, hlen, ferro_header_hash(h, hlen), seq,
                                          b.buf, b.len, o.buf, count, code, op, mean_divisor,
                                          deadline)
        finally:
            PyBuffer_Release(&b)
            PyBuffer_Release(&o)
        if rc == -1:
            raise ValueError(f"fold: unknown dtype code {code} (or no memory)")
        return rc

    cdef int _check_split(self, Py_ssize_t nbytes, Py_ssize_t out_len, Py_ssize_t count,
                          bint scatter) except -1:
        if not (count > 0 and ferro_split_can(&self.s, nbytes, count)
                and (not scatter or count % self.s.n == 0)):
            raise ValueError(f"split: {count} items in {nbytes} bytes cannot run split on "
                             f"{self.s.n} ranks with {self.s.L.slot_bytes}-byte slots")
        if out_len != (nbytes // self.s.n if scatter else nbytes):
            raise ValueError(f"split: {out_len} bytes of output for {nbytes} bytes of input")
        return 0

    def step_gather(self, bytes header not None, uint32_t seq, object src, object out,
                    double deadline):
        """A whole all_gather of blocks of ``len(src)`` bytes, streamed through the slots
        (``_stream.h``); as :meth:`step_allreduce` returns."""
        cdef Py_buffer b, o
        cdef int rc
        cdef const unsigned char* h = header
        cdef size_t hlen = self._header_len(header)
        self._buffers(src, out, &b, &o)
        try:
            if o.len != b.len * self.s.n:
                raise ValueError(f"step_gather: {b.len}-byte blocks do not fill {o.len} bytes")
            with nogil:
                rc = ferro_stream_start(&self.s, h, hlen, ferro_header_hash(h, hlen), seq,
                                        b.buf, b.len, o.buf, deadline)
        finally:
            PyBuffer_Release(&b)
            PyBuffer_Release(&o)
        return rc

    def resume(self, double deadline):
        """The rest of a split or streamed step whose wait ended early (its buffers are the
        ones it started with): OK, or how its wait ended; OK when none is under way."""
        cdef int rc = FERRO_OK
        if self.s.split.active:
            with nogil:
                rc = ferro_split_resume(&self.s, deadline)
        if rc == -1:
            raise ValueError("resume: the fold has no kernel for the dtype (or no memory)")
        return rc

    def fold(self, object out, size_t nbytes, size_t offset, Py_ssize_t count,
             size_t itemsize, int code, int op, double mean_divisor,
             double deadline=float("inf")):
        """A one-step fold's fold alone, on this step's slot data of ``nbytes``; or the rest
        of a split allreduce whose wait ended early (its own buffers; waits until
        ``deadline``): OK, or how its wait ended."""
        cdef Py_buffer o
        cdef int rc
        if self.s.split.active:
            return self.resume(deadline)
        PyObject_GetBuffer(out, &o, PyBUF_WRITABLE)
        try:
            self._check_fold(nbytes, o.len, offset, count, itemsize)
            with nogil:
                rc = ferro_slots_fold(&self.s, o.buf, offset, count, code, op, mean_divisor)
        finally:
            PyBuffer_Release(&o)
        if rc != 0:
            raise ValueError(f"fold: unknown dtype code {code} (or no memory)")
        return FERRO_OK

    cdef int _check_fold(self, Py_ssize_t nbytes, Py_ssize_t out_len, size_t offset,
                         Py_ssize_t count, size_t itemsize) except -1:
        if self.s.fold == NULL:
            raise RuntimeError("SlotEngine: no fold kernel (set_fold was never called)")
        if (count < 0 or <size_t>nbytes > self.s.L.slot_bytes
                or offset + count * itemsize > <size_t>nbytes
                or count * itemsize > <size_t>out_len):
            raise ValueError(f"fold: {count} items at offset {offset} of {nbytes} bytes of slot "
                             f"data (slot {self.s.L.slot_bytes}), output of {out_len} bytes")
        return 0

    cdef int _buffers(self, object src, object out, Py_buffer* b, Py_buffer* o) except -1:
        PyObject_GetBuffer(src, b, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(out, o, PyBUF_WRITABLE)
        except BaseException:
            PyBuffer_Release(b)
            raise
        return 0

    def copy(self, object src, object out, int root):
        """The copies of a one-step broadcast (``root`` >= 0) or all_gather (-1) alone, for a
        step whose wait ended later."""
        cdef Py_buffer b, o
        self._buffers(src, out, &b, &o)
        try:
            self._check_copy(b.len, o.len, root)
            with nogil:
                ferro_slots_copy(&self.s, o.buf, b.buf, b.len, root)
        finally:
            PyBuffer_Release(&b)
            PyBuffer_Release(&o)

    cdef int _check_copy(self, Py_ssize_t nbytes, Py_ssize_t out_len, int root) except -1:
        if root >= self.s.n or root < -1:
            raise ValueError(f"copy: root {root} is not a rank of {self.s.n} (or -1)")
        cdef Py_ssize_t want = nbytes if root >= 0 else nbytes * self.s.n
        if <size_t>nbytes > self.s.L.slot_bytes or out_len != want:
            raise ValueError(f"copy: {nbytes} bytes per rank (slot {self.s.L.slot_bytes}) do "
                             f"not fill an output of {out_len} bytes")
        return 0
