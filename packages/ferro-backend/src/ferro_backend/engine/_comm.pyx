# cython: language_level=3
"""The engine's communicator, for Python: the door (``ferro/engine.h``, ``door.c``) and the steps.

:class:`Comm` owns a C communicator (``_door.h``): it maps the segment from the memfd the job's
ranks share, holds this rank's step state, the order of calls and the errors, and lives until
the last reference goes (this object's, and those C clients took through :meth:`Comm.capsule`).

- ``_calls.Call`` runs one of the door's collectives on buffers, through the same table of C
  functions a C or C++ client calls (``ferro_engine_api``); ferro-collective calls it for every
  engine collective the door has.
- :meth:`Comm.reserve`, :meth:`Comm.begin` and :meth:`Comm.end`: the order of calls (tickets) for
  ferro's own Python steps (``_steps.Steps``), which the collectives only ferro's Python has
  (uneven sizes, objects) run, one turn at a time among the door's calls.
- The segment's bytes (the buffer protocol: ``np.frombuffer(comm, np.uint8)``), the failure
  flag (:attr:`failed_address`) the rings' waits poll, :meth:`mark_failed` and :meth:`close`.

The steps one by one, for ferro's Python, are ``_steps.Steps`` on this communicator.
"""

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_New
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

include "_engine.pxi"

from ferro.engine cimport *

from ferro_backend.forks import track as _track

cdef extern from "_door.h" nogil:
    ctypedef struct ferro_put:
        double ewma_ns
    ctypedef struct ferro_slots:
        unsigned char* base
        ferro_layout L
        int n, me
        uint32_t step
        unsigned long long sent
        size_t hlen
        ferro_put put
    ctypedef struct ferro_comm_impl "struct ferro_comm":
        unsigned char* base
        size_t size
        uint32_t failed
        uint32_t closed
        double timeout
        double stall_fraction
        ferro_slots s
        double reprobe_s
        double probe_put_ns
        int64_t serving
    ferro_comm* ferro_comm_create(int fd, size_t size, int nranks, int rank, size_t slot_bytes,
                                  size_t ring_bytes, int spin, int yields, double timeout,
                                  char* why, size_t why_len)
    const ferro_engine_api* ferro_engine_table()
    void ferro_comm_mark_failed(ferro_comm* c, const char* reason)
    void ferro_comm_forked(ferro_comm* c)
    int ferro_comm_begin(ferro_comm* c, int64_t ticket, double timeout, const char* name)
    void ferro_comm_end(ferro_comm* c, int64_t ticket)
    int ferro_comm_catch_up(ferro_comm* c, int64_t ticket, int64_t count)
    void ferro_comm_break(ferro_comm* c, int status, const char* message)

#: step and call results (ferro/engine.h's ferro_status)
OK, TIMEOUT, FAILED, MISMATCH = FERRO_OK, FERRO_TIMEOUT, FERRO_FAILED, FERRO_MISMATCH
INVALID, CLOSED, BUSY, UNSUPPORTED = FERRO_INVALID, FERRO_CLOSED, FERRO_BUSY, FERRO_UNSUPPORTED
#: the name of the capsule :meth:`Comm.capsule` returns, and the ABI its clients must speak
CAPSULE_NAME = FERRO_ENGINE_CAPSULE.decode()
ABI_VERSION = (FERRO_ENGINE_ABI_MAJOR, FERRO_ENGINE_ABI_MINOR)
cdef const char* _CAPSULE = FERRO_ENGINE_CAPSULE
cdef const ferro_engine_api* _api = ferro_engine_table()


def last_error() -> str:
    """This thread's last failed door call's message."""
    return _api.last_error().decode("utf-8", "replace")


def status_name(int status) -> str:
    return _api.status_name(status).decode()


cdef void _release_capsule(object capsule) noexcept:
    cdef ferro_comm* c = <ferro_comm*>PyCapsule_GetPointer(capsule, _CAPSULE)
    if c != NULL:
        _api.release(c)


cdef void _stall_report(void* ctx, const char* message) noexcept nogil:
    with gil:
        try:
            hook = (<Comm>ctx)._stall
            if hook is not None:
                hook(message.decode("utf-8", "replace"))
        except BaseException:  # a report must never break the wait it reports on
            pass


def _mark_forked(comm, made_pid, pid):
    comm.mark_forked()


cdef class Comm:
    """This rank's communicator on the segment in ``fd`` (``size`` bytes, the layout of
    ``nranks`` ranks with ``slot_bytes`` slots and ``ring_bytes`` rings); waits spin ``spin``
    times, then yield ``yields`` times, before they sleep; ``timeout``: the default of a door
    call."""

    cdef ferro_comm* c
    cdef ferro_comm_impl* impl
    cdef ferro_slots* s
    cdef readonly object _stall
    cdef Py_ssize_t exports
    cdef object __weakref__

    def __cinit__(self, int fd, size_t size, int nranks, int rank, size_t slot_bytes,
                  size_t ring_bytes, int spin, int yields, double timeout):
        cdef char why[256]
        why[0] = 0
        self.c = ferro_comm_create(fd, size, nranks, rank, slot_bytes, ring_bytes, spin, yields,
                                   timeout, why, sizeof(why))
        if self.c == NULL:
            raise ValueError(f"engine communicator of rank {rank} of {nranks}: "
                             f"{why.decode('utf-8', 'replace')}")
        self.impl = <ferro_comm_impl*>self.c
        self.s = &self.impl.s
        _track(self, _mark_forked)

    def __dealloc__(self):
        if self.c != NULL:
            _api.set_stall_report(self.c, NULL, NULL)
            _api.release(self.c)

    # ------------------------------------------------------------------ the segment
    def __getbuffer__(self, Py_buffer* view, int flags):
        view.buf = self.impl.base
        view.len = self.impl.size
        view.readonly = 0
        view.itemsize = 1
        view.format = NULL
        if flags & PyBUF_FORMAT:
            view.format = b"B"
        view.ndim = 1
        view.shape = NULL
        if flags & PyBUF_ND:
            view.shape = &view.len
        view.strides = NULL
        if (flags & PyBUF_STRIDES) == PyBUF_STRIDES:
            view.strides = &view.itemsize
        view.suboffsets = NULL
        view.internal = NULL
        view.obj = self
        self.exports += 1

    def __releasebuffer__(self, Py_buffer* view):
        self.exports -= 1

    @property
    def address(self) -> int:
        """Where the segment is mapped."""
        return <size_t>self.impl.base

    @property
    def failed_address(self) -> int:
        """The address of the failure flag (a u32) every wait on the segment polls."""
        return <size_t>&self.impl.failed

    @property
    def failed(self) -> bool:
        return ferro_load(&self.impl.failed) != 0

    @property
    def closed(self) -> bool:
        return ferro_load(&self.impl.closed) != 0

    def mark_failed(self, str reason=""):
        """A peer died, closed or aborted (``reason``, kept if it is the first): every wait on
        the segment ends now, and every later call reports it."""
        cdef bytes why = reason.encode("utf-8", "replace")
        ferro_comm_mark_failed(self.c, why)

    def mark_forked(self):
        """This communicator is a forked child's copy: closed in this process only (every call
        here: CLOSED), with nothing written to the shared segment and nobody woken."""
        ferro_comm_forked(self.c)

    def close(self):
        """Every later call: CLOSED; calls in flight end at once."""
        _api.close(self.c)

    def capsule(self):
        """A capsule named :data:`CAPSULE_NAME` holding the ``ferro_comm*`` (with a reference
        of its own, released with the capsule): what a C or C++ client attaches to."""
        _api.retain(self.c)
        return PyCapsule_New(self.c, _CAPSULE, _release_capsule)

    def set_stall_report(self, hook):
        """Call ``hook(message)`` once per door call that waits half its timeout (None: no
        report)."""
        self._stall = hook
        if hook is None:
            _api.set_stall_report(self.c, NULL, NULL)
        else:
            _api.set_stall_report(self.c, _stall_report, <void*>self)

    @property
    def stall_fraction(self) -> float:
        """A door call reports a stall (:meth:`set_stall_report`) after this part of its
        timeout."""
        return self.impl.stall_fraction

    @stall_fraction.setter
    def stall_fraction(self, double value):
        self.impl.stall_fraction = value

    @property
    def timeout(self) -> float:
        return self.impl.timeout

    @timeout.setter
    def timeout(self, double value):
        self.impl.timeout = value

    @property
    def reprobe_seconds(self) -> float:
        """Rank 0 asks every rank to probe the link again after a door call at most this many
        seconds after the last probe, sooner when its copies into shared memory change speed
        (``door.c``: ask_reprobe); 0: never. Only rank 0's counts."""
        return self.impl.reprobe_s

    @reprobe_seconds.setter
    def reprobe_seconds(self, double value):
        if not value >= 0:
            raise ValueError(f"reprobe_seconds: {value} is not a number of seconds >= 0")
        self.impl.reprobe_s = value

    @property
    def copy_ns_per_kib(self) -> float:
        """This rank's recent plain copies into shared memory, ns per KiB (``_put.h``; 0 before
        the first timed one)."""
        return self.s.put.ewma_ns

    @property
    def copy_ns_at_probe(self) -> float:
        """:attr:`copy_ns_per_kib` as the last link probe ended (0: not yet taken): rank 0 asks
        for a re-probe when its copies move 2x from it."""
        return self.impl.probe_put_ns

    @copy_ns_at_probe.setter
    def copy_ns_at_probe(self, double value):
        self.impl.probe_put_ns = value

    # ------------------------------------------------------------------ the order of calls
    def reserve(self) -> int:
        """The next ticket: a call's place in the order of calls (and its sequence number)."""
        return _api.reserve(self.c)

    def skip(self, int64_t ticket) -> int:
        """Give back a reserved ticket without running it (a call that never ran)."""
        return _api.skip(self.c, ticket)

    def catch_up(self, int64_t ticket, int64_t count) -> bool:
        """``ticket``'s call (in its turn) took ``count`` fewer tickets than a peer's call at
        the same place (their headers' spans, after a mismatch): give the next ``count`` back
        unrun. False where a call reserved one after it (they keep their tickets)."""
        rc = ferro_comm_catch_up(self.c, ticket, count)
        if rc < 0:
            raise MemoryError("catch_up: no memory to remember the tickets given back")
        return rc == 1

    def begin(self, int64_t ticket, double timeout, str name) -> int:
        """Wait up to ``timeout`` seconds for ``ticket``'s turn, for Python's own steps: OK, or
        a status whose message :func:`last_error` gives; :meth:`end` gives the turn back."""
        cdef bytes bname = name.encode()
        cdef const char* cname = bname
        cdef int rc
        if self.impl.serving == ticket:  # its turn already (only its caller moves it on): no
            return ferro_comm_begin(self.c, ticket, timeout, cname)  # wait, the GIL kept
        with nogil:
            rc = ferro_comm_begin(self.c, ticket, timeout, cname)
        return rc

    def end(self, int64_t ticket):
        """``ticket``'s turn is over (nothing if it already is)."""
        ferro_comm_end(self.c, ticket)

    def break_with(self, int status, str message):
        """The communicator is broken (a Python step's timeout or failure): every later call
        returns ``status`` with ``message``."""
        ferro_comm_break(self.c, status, message.encode("utf-8", "replace"))

    # ------------------------------------------------------------------ this rank's steps
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

    @property
    def slot_bytes(self) -> int:
        return self.s.L.slot_bytes

    @property
    def steps_address(self) -> int:
        """The address of this rank's step state (``ferro_slots``), for :class:`._steps.Steps`
        (which keeps this communicator alive)."""
        return <size_t>self.s

    @property
    def comm_address(self) -> int:
        """The address of the C communicator (``ferro_comm``), for :class:`._calls.Call` (which
        keeps this communicator alive)."""
        return <size_t>self.c
