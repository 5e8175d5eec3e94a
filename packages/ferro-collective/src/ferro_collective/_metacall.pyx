# cython: language_level=3
"""The one-call paths of scatter and the all-to-alls: the compiled twin of their engine path
(this module: the twin's steps and scatter; :mod:`._exchange_twin`: all_to_all_single and
all_to_all).

Not every rank of these calls knows the sizes before the call (a scatter's non-roots pass
nothing; a rank of an all-to-all knows its own splits only), so no rank can pick the engine
door's fixed-size calls by itself. Their general path, a
:class:`~.metadata_step.MetaPlan`, runs one engine step that carries the header, every rank's
metadata (the root's dtype and shape; every rank's row counts) and the data when it fits in the
slot (else the addresses its peers read it from); then every rank copies its pieces
(:func:`~.metadata_step.put_pieces`, :func:`~.metadata_step.get_pieces`).

:class:`Twin` runs that same protocol in C, byte for byte: the same header, metadata, payload
layout and placement rule, in the same ticket's turn, with the same errors (every check that
depends on the peers' metadata is the general path's own function, called only when the
metadata is new). So each rank may take the twin or the general path independently, and the
ranks still meet. It takes the common case and answers None before taking a ticket for any
other (then the general path runs the call): an exact ndarray, C-contiguous; splits given as
None or as lists of ints; an ``out=`` that is an ndarray; and an engine whose slots hold the
metadata and that lets ranks read each other's memory (``cma_ok``, the same on every rank:
without it large data goes over messages, which only the general path runs).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memmove, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cimport numpy as cnp

import numpy as np

from ferro_backend import Backend, CollectiveMismatchError, CollectiveTimeoutError
from ferro_backend import PeerClosedError

from . import p2p
from .arguments import check_out
from .header import INVALID, encode
from .metadata_sizes import scatter_block, split_plan
from .metadata_step import DESC_SIZE, ROTATE_MIN, guard, pack_desc, payload_offset

cnp.import_array()

cdef dict _p2p = p2p.__dict__
cdef object _EMPTY = np.empty
cdef Py_ssize_t _DESC = DESC_SIZE
cdef Py_ssize_t _SCATTER_BLOCK = 8 + DESC_SIZE      # status + descriptor
cdef Py_ssize_t _SCATTER_OFF = payload_offset(8 + DESC_SIZE)
cdef int _OK = 0
cdef int64_t _INVALID = INVALID
cdef Py_ssize_t _SEQ_AT = 24                         # a header's sequence number (header.py)
cdef Py_ssize_t _SPAN_AT = 6                         # ... and its span
cdef object _Backend_timeout = Backend.timeout
cdef Py_ssize_t _ROTATE_MIN = ROTATE_MIN


cdef double now() noexcept nogil:
    cdef timespec t
    clock_gettime(CLOCK_MONOTONIC, &t)
    return t.tv_sec + t.tv_nsec * 1e-9


cdef bint overlap(char* a, Py_ssize_t na, char* b, Py_ssize_t nb) noexcept:
    return na > 0 and nb > 0 and a < b + nb and b < a + na


cdef bint plain_array(object x):
    return cnp.PyArray_CheckExact(x) and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>x)


cdef object fast_out(object out, tuple shape, object dtype):
    """``out`` when the call can write it as it is (an exact, writable, C-contiguous ndarray of
    ``shape`` and ``dtype``), else None."""
    cdef cnp.ndarray o
    if not cnp.PyArray_CheckExact(out):
        return None
    o = <cnp.ndarray>out
    if (not cnp.PyArray_IS_C_CONTIGUOUS(o) or not cnp.PyArray_ISWRITEABLE(o)
            or (<object>o).shape != shape
            or not cnp.PyArray_EquivTypes(<cnp.dtype>cnp.PyArray_DESCR(o), <cnp.dtype>dtype)):
        return None
    return o


cdef class Twin:
    """The twin of one engine group (:class:`~.engine_group.EngineGroup`, which makes it): the
    slots' addresses, the headers' templates, and the last call's metadata with what was
    worked out from it (every cache is replaced whole under the GIL: threads may share it)."""

    def __cinit__(self, g, step):
        """The twin of engine group ``g``; ``step``: the class of a call in progress that its
        waits take (:class:`~.engine_group.Step`)."""
        cdef int r, p
        self.make_step = step
        self.g, self.comm, self.steps, self.engine = g, g.comm, g.steps, g.engine
        self.backend = g.backend
        self.plain_timeout = getattr(type(self.backend), "timeout", None) is _Backend_timeout
        self.n, self.me = g.n, g.me
        self.slot_bytes, self.cma_ok = g.slot_bytes, bool(g.cma_ok)
        self._keep = [g.engine.slot_data(r, p) for r in range(self.n) for p in range(2)]
        self.slots = <char**>malloc(2 * self.n * sizeof(char*))
        if self.slots == NULL:
            raise MemoryError()
        for r in range(2 * self.n):
            self.slots[r] = <char*>cnp.PyArray_DATA(<cnp.ndarray>self._keep[r])
        self._scatter_headers = [None] * self.n
        # the all-to-alls' metadata: status + send and recv splits; status + rows per rank
        self.a2a_single_off = payload_offset(8 + 16 * self.n)
        self.a2a_off = payload_offset(8 + 8 * self.n)

    def __dealloc__(self):
        free(self.slots)

    cdef char* slot(self, int rank, uint32_t step):
        return self.slots[2 * rank + (step & 1)]

    cdef Py_ssize_t rot(self, uint32_t step, Py_ssize_t off, Py_ssize_t nbytes) except -1:
        """:func:`.metadata_step.payload_rot`: where ``nbytes`` of a rank's data start after the
        metadata (at ``off``) in its slot of ``step``."""
        if off + nbytes < _ROTATE_MIN:
            return 0
        return self.steps.rot(step, off + nbytes)

    cdef bint usable(self, Py_ssize_t off):
        """Whether the engine can run a call whose payload starts at ``off``: the metadata and
        every rank's addresses fit in a slot, ranks may read each other's memory (where there
        are others), and the group and its door are neither broken nor closed (the general path
        names why)."""
        return ((self.cma_ok or self.n == 1) and off + 8 * self.n <= self.slot_bytes
                and self.g.broken is None
                and not self.comm.failed and not self.comm.closed)

    cdef object timeout_of(self, object timeout, str name):
        """The call's timeout in seconds, or None where the general path must refuse it."""
        if timeout is None and self.plain_timeout:
            return self.backend._timeout
        try:
            return self.g._resolve(timeout, name)
        except (TypeError, ValueError):
            return None

    cdef object step_meta(self, str name, bytes template, object seq, double secs,
                          double start, uint32_t step, Py_ssize_t filled, uint16_t span=0):
        """The metadata step ``step`` (this rank's slot filled with ``filled`` bytes): publish
        the header (``template`` with ``seq``, and ``span``: the numbers the caller's whole call
        takes, a compressed call's decider's), wait, compare headers; then the ranks whose own
        arguments were invalid make it a mismatch. Returns the ``Step`` made for a late wait,
        or None."""
        cdef int rc, r
        cdef bytes header = PyBytes_FromStringAndSize(PyBytes_AS_STRING(template),
                                                      len(template))
        cdef uint32_t s = <uint32_t>(<uint64_t>seq & 0xFFFFFFFF)
        memcpy(PyBytes_AS_STRING(header) + _SEQ_AT, &s, 4)  # (little-endian, as the door)
        if span:
            memcpy(PyBytes_AS_STRING(header) + _SPAN_AT, &span, 2)
        call = None
        rc = self.steps.exchange(header, None, filled, None,
                                 start + secs * <double>_p2p["STALL_FRACTION"])
        if rc != _OK:
            call = self.make_step(name, seq, secs, start)
            self.g._settle(rc, call)
        for r in range(self.n):
            if (<int64_t*>self.slot(r, step))[0] & _INVALID:
                bad = [r for r in range(self.n) if (<int64_t*>self.slot(r, step))[0] & _INVALID]
                raise CollectiveMismatchError(
                    f"{name} (seq {seq}): ranks {bad} passed invalid arguments (see the error "
                    "on those ranks)")
        return call

    cdef object turn(self, str name, double secs, TurnBody body, object x, object arg,
                     object out, int64_t* ints):
        """Run ``body`` in the call's ticket's turn, as :meth:`.EngineGroup.run` runs a plan."""
        seq = self.comm.reserve()
        cdef double start = now()
        self.taken += 1
        try:
            rc = self.comm.begin(seq, secs, name)
            if rc != _OK:
                self.g._raise(rc, name, seq, secs)
            return body(self, seq, secs, start, x, arg, out, ints)
        except (CollectiveTimeoutError, PeerClosedError) as exc:
            if self.g.broken is None:  # (the first failure: later calls name it after theirs)
                self.g.broken = exc
            raise
        finally:
            self.comm.end(seq)

    # ------------------------------------------------------------------ scatter
    cdef object scatter(self, object tensor, int root, object timeout, object out):
        """:func:`ferro_collective.scatter`, or None where the general path must run it."""
        cdef cnp.ndarray x = None
        desc = None
        if not self.usable(_SCATTER_OFF) or (out is not None and not cnp.PyArray_Check(out)):
            return None
        if self.me == root:
            if not plain_array(tensor):
                return None
            x = <cnp.ndarray>tensor
            if x.ndim == 0 or x.shape[0] % self.n or x.descr.hasobject or x.itemsize == 0:
                return None
            if (<object>x).dtype is not self._root_dtype or \
                    (<object>x).shape != self._root_shape:
                desc, bad = guard(lambda: pack_desc(x))
                if bad is not None:
                    return None
                self._root_dtype, self._root_shape, self._root_desc = \
                    (<object>x).dtype, (<object>x).shape, desc
            desc = self._root_desc  # (before a Python call: another thread may replace it)
        secs = self.timeout_of(timeout, "scatter")
        if secs is None:
            return None
        return self.turn("scatter", secs, _scatter, x, (root, desc), out, NULL)


cdef object _scatter(Twin self, object seq, double secs, double start, object xo, object arg,
                     object out, int64_t* unused):
    """The scatter in its turn (``arg``: the root and, on the root, its descriptor)."""
    cdef int n = self.n, me = self.me, d
    cdef uint32_t step = <uint32_t>self.steps.step
    cdef char* mine
    cdef char* pay
    cdef Py_ssize_t room = self.slot_bytes - _SCATTER_OFF, size, total = 0, pos = 0
    cdef char* data = NULL
    cdef char* src
    cdef char* dst
    cdef bint direct, own_last = False
    cdef cnp.ndarray x = xo
    cdef int root = arg[0]
    cdef bytes desc = arg[1]
    step += 1  # (wraps as the engine's count does)
    mine = self.slot(me, step)
    pay = mine + _SCATTER_OFF
    memset(mine, 0, 8)
    if x is None:
        memset(mine + 8, 0, _DESC)
    else:  # the root: its descriptor, and its blocks for the others or their addresses
        memcpy(mine + 8, PyBytes_AS_STRING(desc), _DESC)
        data = <char*>cnp.PyArray_DATA(x)
        size = cnp.PyArray_NBYTES(x) // n
        if (n - 1) * size <= room:
            pay += self.rot(step, _SCATTER_OFF, (n - 1) * size)
            for d in range(n):
                if d != me and size:
                    memcpy(pay + total, data + d * size, size)
                    total += size
        else:
            for d in range(n):
                (<uint64_t*>pay)[d] = <uint64_t><size_t>(data + d * size)
    template = self._scatter_headers[root]
    if template is None:
        template = self._scatter_headers[root] = encode("scatter", None, (), None, root)
    call = self.step_meta("scatter", template, seq, secs, start, step, _SCATTER_BLOCK + total)
    cdef char* theirs = self.slot(root, step)
    if self._desc_seen is None or \
            memcmp(theirs + 8, PyBytes_AS_STRING(self._desc_seen), _DESC) != 0:
        seen = PyBytes_FromStringAndSize(theirs + 8, _DESC)
        block = scatter_block(seen, root, n)
        self._block, self._desc_seen = block, seen
    dtype, shape = self._block
    # the result: out as it is, or a new array (a bad out still takes part, then raises)
    late = None
    res = None if out is None else fast_out(out, shape, dtype)
    if out is not None and res is None:
        res, late = guard(lambda: check_out("scatter", out, shape, dtype))
    if res is None or late is not None:
        res = _EMPTY(shape, dtype)
    dst = <char*>cnp.PyArray_DATA(<cnp.ndarray>res)
    size = cnp.PyArray_NBYTES(<cnp.ndarray>res)
    direct = (n - 1) * size > room
    if me == root:
        own_last = out is not None and overlap(dst, size, data, size * n)
        if not own_last:
            memmove(dst, data + me * size, size)
    elif size:
        src = theirs + _SCATTER_OFF
        if direct:
            self.g.read(root, (<uint64_t*>src)[me], res)
        else:
            memcpy(dst, src + self.rot(step, _SCATTER_OFF, (n - 1) * size)
                   + (me - (me > root)) * size, size)
    if direct:  # nobody reads the root's memory any more
        self.g.sync(call if call is not None else self.make_step("scatter", seq, secs, start))
    if own_last:
        memmove(dst, data + me * size, size)
    if late is not None:
        raise late
    return res
