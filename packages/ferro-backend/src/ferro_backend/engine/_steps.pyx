# cython: language_level=3
"""The engine's steps one by one, for ferro's Python: the collectives only it runs.

A rank takes part in step ``s`` by writing its slot ``s % 2`` (a collective header, optional
cross-memory addresses and data), then publishing ``step = s``; it waits until every rank has
published ``s``, then compares headers (``_steps.h``). The door (``_comm.Comm``) runs whole
collectives on the same steps; ferro-collective runs the ones it alone has (uneven sizes,
objects, a scatter whose non-roots pass nothing) with :class:`Steps`, inside its ticket's turn
(``Comm.begin`` / ``Comm.end``), so both kinds keep one order and one step count.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, uint32_t, uint64_t

include "_engine.pxi"

cdef extern from "_door.h" nogil:
    uint32_t FERRO_SEQ_OFF
    ctypedef struct ferro_put:
        size_t small_bytes
        double slow_ns
    ctypedef struct ferro_slots:
        unsigned char* base
        ferro_layout L
        int n, me
        uint32_t step
        unsigned long long sent
        size_t hlen
        int clock
        double waited
        size_t split_min
        ferro_put put
        void (*hook)(void* ctx, int waiting) noexcept nogil
        void* hook_ctx
        int hooked
    double ferro_copy_ns_per_kib(double (*now)() noexcept nogil)
    uint64_t ferro_header_hash(const unsigned char* h, size_t len)
    ferro_slot_head* ferro_slots_slot(ferro_slots* s, int rank, uint32_t step)
    void ferro_slots_publish(ferro_slots* s, uint32_t step)
    int ferro_slots_wait_all(ferro_slots* s, uint32_t step, double deadline)
    int ferro_slots_agree(ferro_slots* s)
    int ferro_slots_exchange(ferro_slots* s, const unsigned char* header, size_t hlen, int patch,
                             uint64_t hash, uint32_t seq, const unsigned char* src,
                             size_t nbytes, size_t span, double deadline)
    size_t ferro_slots_rot(const ferro_slots* s, uint32_t step, size_t span)
    int ferro_slots_sync(ferro_slots* s, double deadline)
    int ferro_slots_wait_word(ferro_slots* s, uint32_t* word, uint32_t target,
                              uint32_t* sleepers, double deadline)
    size_t FERRO_HEADER_BYTES
    size_t FERRO_ROTATE_MIN

cdef extern from "_gil.h":
    void ferro_gil_hook(void* ctx, int waiting) noexcept nogil

#: step results (ferro/engine.h's statuses)
OK, TIMEOUT, FAILED, MISMATCH = FERRO_OK, FERRO_TIMEOUT, FERRO_FAILED, FERRO_MISMATCH
#: where a collective header holds its sequence number
HEADER_SEQ_OFFSET = FERRO_SEQ_OFF
#: a step's data of at least this many bytes per rank moves through the slot (:meth:`Steps.rot`)
ROTATE_MIN = FERRO_ROTATE_MIN


cdef enum:
    HOLD_BYTES = 65536  # a step that copies more lets the GIL go first (the door's rule)


cdef inline void _hold(ferro_slots* s) noexcept:
    """A step made with the GIL held: its waits let it go beyond a short spin (_gil.h)."""
    s.hook, s.hook_ctx, s.hooked = ferro_gil_hook, NULL, 0


cdef inline void _release(ferro_slots* s) noexcept:
    """The step is over: the GIL back if a wait let it go."""
    if s.hooked:
        ferro_gil_hook(NULL, 0)
    s.hook, s.hooked = NULL, 0


def header_hash(const unsigned char[::1] header) -> int:
    """The hash a rank publishes with a step's ``header``, without its sequence number."""
    return ferro_header_hash(&header[0] if header.shape[0] else NULL, header.shape[0])


cdef class Steps:
    """This rank's steps on ``comm``'s segment (a ``_comm.Comm``, kept alive while these
    are)."""

    cdef ferro_slots* s
    cdef readonly object comm

    def __init__(self, comm):
        self.comm = comm
        self.s = <ferro_slots*><size_t>comm.steps_address

    @property
    def step(self) -> int:
        return self.s.step

    def timed_waits(self, bint on) -> float:
        """Time the steps' waits for peers (``on``) or not; the seconds waited while timed."""
        self.s.clock = on
        return self.s.waited

    @property
    def split_bytes(self) -> int:
        """Allreduces of at least this many bytes (within a slot) run split: each rank folds
        one part, pipelined in chunks (``_split.h``); 0: never (beyond a slot: always)."""
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
        cdef ferro_slot_head* mine = ferro_slots_slot(self.s, self.s.me, self.s.step + 1)
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
            if have and <size_t>b.len > HOLD_BYTES:
                with nogil:
                    rc = ferro_slots_exchange(self.s, h, hlen, 0, 0, 0,
                                              <const unsigned char*>b.buf, <size_t>b.len, span,
                                              deadline)
            else:  # a peer that has arrived costs no GIL round trip
                _hold(self.s)
                rc = ferro_slots_exchange(self.s, h, hlen, 0, 0, 0,
                                          <const unsigned char*>b.buf if have else NULL,
                                          <size_t>b.len if have else 0, span, deadline)
                _release(self.s)
            self.s.sent += prefilled
        finally:
            if have:
                PyBuffer_Release(&b)
        return rc

    def step_barrier(self, bytes header not None, uint32_t seq, double deadline):
        """A step with no data, ``header`` with ``seq`` patched in (as the door's calls publish
        theirs): OK, TIMEOUT, FAILED or MISMATCH."""
        cdef int rc
        cdef const unsigned char* h = header
        cdef size_t hlen = len(header)
        cdef uint64_t hash
        if hlen > FERRO_HEADER_ROOM:
            raise ValueError(f"step_barrier: a {hlen}-byte header exceeds "
                             f"{FERRO_HEADER_ROOM}")
        hash = ferro_header_hash(h, hlen)
        with nogil:
            rc = ferro_slots_exchange(self.s, h, hlen, 1, hash, seq, NULL, 0, 0, deadline)
        return rc

    def rot(self, uint32_t step, size_t span) -> int:
        """Where ``step``'s data starts in each slot, ``span`` bytes per rank (_onestep.h)."""
        return ferro_slots_rot(self.s, step, span)

    def sync(self, double deadline):
        """A step without slot writes (all finished the last one): OK, TIMEOUT or FAILED."""
        cdef int rc
        _hold(self.s)
        rc = ferro_slots_sync(self.s, deadline)
        _release(self.s)
        return rc

    def wait(self, double deadline):
        """Wait (again) for every rank to reach this rank's step; OK, TIMEOUT or FAILED."""
        cdef int rc
        _hold(self.s)
        rc = ferro_slots_wait_all(self.s, self.s.step, deadline)
        _release(self.s)
        return rc

    def withdraw(self):
        """Publish the step before this one (who gives up on a step must not look arrived)."""
        ferro_slots_publish(self.s, self.s.step - 1)

    def headers_agree(self) -> bool:
        """Whether every rank's header of this step equals this rank's."""
        return ferro_slots_agree(self.s) != 0

    def headers(self) -> list:
        """Every rank's header of this step (this step's header length each)."""
        return [bytes(ferro_slots_slot(self.s, j, self.s.step).header[:self.s.hlen])
                for j in range(self.s.n)]

    def extras(self) -> list:
        """Every rank's ``(pid, input address, output address)`` of this step."""
        cdef ferro_slot_head* h
        out = []
        for j in range(self.s.n):
            h = ferro_slots_slot(self.s, j, self.s.step)
            out.append((h.pid, h.in_addr, h.out_addr))
        return out

    def missing(self) -> list:
        """The ranks that have not published this rank's step yet (for error messages)."""
        return [j for j in range(self.s.n) if j != self.s.me and
                <int32_t>(ferro_load(&ferro_ctrl_of(self.s.base, &self.s.L, j).step)
                          - self.s.step) < 0]

    def peek(self, int rank, double deadline):
        """``(status, header)``: wait until ``rank`` has posted the next step (OK, TIMEOUT or
        FAILED) and read its header there, before this rank posts its own (a broadcast's
        non-root that passed no array learns the root's dtype and shape this way). Its slot
        stays put until this rank has posted and met that step."""
        cdef int rc
        if not 0 <= rank < self.s.n or rank == self.s.me:
            raise ValueError(f"Steps.peek: rank {rank} is not a peer of rank {self.s.me}")
        cdef ferro_ctrl* c = ferro_ctrl_of(self.s.base, &self.s.L, rank)
        cdef uint32_t target = self.s.step + 1
        with nogil:
            rc = ferro_slots_wait_word(self.s, &c.step, target, &c.sleepers, deadline)
        if rc != FERRO_OK:
            return rc, b""
        return rc, bytes(ferro_slots_slot(self.s, rank, target).header[:FERRO_HEADER_BYTES])

    def published(self, int rank) -> int:
        """The last step ``rank`` published."""
        return ferro_load(&ferro_ctrl_of(self.s.base, &self.s.L, rank).step)
