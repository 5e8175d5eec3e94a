# cython: language_level=3
"""The engine's one-call paths, compiled: from the Python call to the engine's step with no
Python in between for the common case.

A small collective on a backend with a same-host engine is one engine step (header and data into
this rank's slot, publish, wait, compare headers, fold or copy every rank's slot). :class:`Core`,
the base of :class:`~.engine.EngineGroup`, runs it whole in C: the input's signature (dtype,
shape, op or root) finds its :class:`FastPlan` in a direct-mapped cache, ``out=`` is checked
against the plan (or the result allocated), the call takes its sequence number and its turn, and
the step runs without the GIL through the table of C functions ferro-backend exports
(``SlotEngine.api()``). Plans are the collectives' modules' (their makers, :func:`register`): a
signature's checks run once, when its plan is made. A call that is not this case (another type,
a strided input, an ``out=`` of another shape or dtype, a reduction beyond a slot) answers
:data:`NOT_TAKEN` before taking a sequence number, and the general path checks it and names what
is wrong; a step that does not end well goes to the group's Python recovery, as every path's.
"""

from cpython.object cimport PyObject
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_Check, PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.string cimport memcmp, memcpy

cimport numpy as cnp


from . import p2p
from .checks import fast_array
from .ops import ReduceOp

from ferro_backend import Backend as _Backend

from ._fastplan cimport MAX_DIMS, FastPlan, SeqCounter

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    # steals a reference to descr (numpy's pxd leaves it out for that reason)
    object PyArray_Empty(int nd, cnp.npy_intp* dims, cnp.PyArray_Descr* descr, int fortran)

include "_steptable.pxi"

#: what a one-call path answers for a call it does not take
NOT_TAKEN = object()
cdef object _NOT_TAKEN = NOT_TAKEN
#: the collectives with a one-call path (the kinds of :func:`register`)
ALLREDUCE, REDUCE_SCATTER, BROADCAST, ALL_GATHER, BARRIER, GATHER = range(6)
cdef enum:
    K_FOLD_FIRST = 0
    K_FOLD_LAST = 1
    K_BROADCAST = 2
    K_ALL_GATHER = 3
    K_BARRIER = 4
    K_GATHER = 5
    KINDS = 6
    CACHE = 512             # direct-mapped plan cache entries (a power of two)
    FERRO_OK = 0
cdef list _makers = [None] * KINDS
cdef dict _p2p = p2p.__dict__
cdef object _ReduceOp = ReduceOp
cdef object _general = None


def register(int kind, maker) -> None:
    """Take ``maker(group, x, arg)``: the :class:`FastPlan` of ``kind`` for an input like ``x``
    and the collective's own argument ``arg`` (op or root), or None when one call cannot run it.
    Each collective's module registers its own when imported."""
    if not 0 <= kind < KINDS:
        raise ValueError(f"register: kind {kind} is not one of 0..{KINDS - 1}")
    _makers[kind] = maker


cdef class Core:
    """The compiled half of :class:`~.engine.EngineGroup`: call order (the next sequence number
    to run, waiters, the error that broke the group) and the one-call paths."""

    cdef slots_api* api
    cdef object _slots_keep
    cdef object _counter, _backend
    cdef SeqCounter _seq_counter
    cdef list _cache
    cdef FastPlan _barrier
    cdef public long long _next_seq   # the next call to run (-1: none ran yet)
    cdef public int _waiting          # calls waiting for their turn
    cdef public object broken         # the error that broke the group, or None
    cdef public int n, me
    cdef bint _plain_timeout

    def _bind(self, backend, slots, counter, bytes barrier_header, uint64_t barrier_hash):
        """Take ``slots``' step table (its ``api()`` capsule), the backend's sequence numbers
        (``counter()``) and the barrier's header."""
        capsule = slots.api()
        if not PyCapsule_IsValid(capsule, _API_NAME):
            raise TypeError("ferro_collective: ferro-backend's engine offers another step table "
                            f"than this build calls ({capsule!r}); install matching versions")
        self.api = <slots_api*>PyCapsule_GetPointer(capsule, _API_NAME)
        self._slots_keep, self._counter, self._backend = slots, counter, backend
        self._seq_counter = counter if isinstance(counter, SeqCounter) else None
        self._cache = [None] * CACHE
        self._barrier = FastPlan("barrier", barrier_header, (), barrier_hash)
        self._next_seq, self._waiting, self.broken = -1, 0, None
        self.n, self.me = slots.n, slots.me
        self._plain_timeout = getattr(type(backend), "timeout", None) is _Backend.timeout

    # ------------------------------------------------------------------ order
    def _done(self, long long seq):
        """Call ``seq`` has finished: the next may run."""
        self._finish(seq)

    cdef inline int _finish(self, long long seq) except -1:
        self._next_seq = seq + 1
        if self._waiting:
            self._notify()
        return 0

    cdef int _enter(self, str name, object timeout, double* t, long long* seq,
                    double* start) except -1:
        """The call's timeout, sequence number and start once its turn came."""
        if timeout is not None:
            t[0] = self._resolve(timeout, name)
        else:  # the backend's timeout; its private value where Backend's property returns it
            t[0] = self._backend._timeout if self._plain_timeout else self._backend.timeout
        if self._seq_counter is not None:
            seq[0] = self._seq_counter.value
            self._seq_counter.value += 1
        else:
            seq[0] = self._counter()
        start[0] = _now()
        if self._next_seq != seq[0]:
            self._wait_turn_for(name, seq[0], t[0], start[0])
        if self.broken is not None:
            self._finish(seq[0])
            raise self.broken
        return 0

    # ------------------------------------------------------------------ plans
    cdef Py_ssize_t _index(self, int kind, cnp.ndarray x, Py_ssize_t arg_key):
        """The cache entry of a signature: dtype, shape and argument hashed (-1: not cached,
        more than MAX_DIMS dims)."""
        cdef int ndim = cnp.PyArray_NDIM(x), i
        cdef cnp.npy_intp* dims = cnp.PyArray_DIMS(x)
        cdef size_t h = (<size_t>kind * 0x9E3779B1u ^ <size_t>cnp.PyArray_DESCR(x)
                         ^ <size_t>arg_key * 31u)
        if ndim > MAX_DIMS:
            return -1
        for i in range(ndim):
            h = h * 1000003u ^ <size_t>dims[i]
        h ^= h >> 17
        return h & (CACHE - 1)

    cdef FastPlan _cached(self, Py_ssize_t at, int kind, cnp.ndarray x, Py_ssize_t arg_key):
        cdef object slot = self._cache[at]
        cdef FastPlan p
        cdef int ndim = cnp.PyArray_NDIM(x)
        if slot is None:
            return None
        p = <FastPlan>slot
        if (p.kind == kind and <PyObject*>p.descr == <PyObject*>cnp.PyArray_DESCR(x)
                and p.arg_key == arg_key and p.ndim == ndim
                and memcmp(p.dims, cnp.PyArray_DIMS(x), ndim * sizeof(cnp.npy_intp)) == 0):
            return p
        return None

    cdef FastPlan _plan(self, int kind, cnp.ndarray x, object arg, Py_ssize_t arg_key):
        """The plan of the call's signature: cached, or made by the collective's maker."""
        cdef Py_ssize_t at = self._index(kind, x, arg_key)
        cdef FastPlan p
        if at < 0:
            return None
        p = self._cached(at, kind, x, arg_key)
        if p is not None:
            return p
        made = _makers[kind](self, x, arg)
        if made is None:
            p = FastPlan("", b"", (), 0)
            p.taken = False
        else:
            p = <FastPlan?>made
        p.kind, p.ndim, p.descr, p.arg = kind, cnp.PyArray_NDIM(x), <object>cnp.PyArray_DESCR(x), arg
        p.arg_key = arg_key
        memcpy(p.dims, cnp.PyArray_DIMS(x), p.ndim * sizeof(cnp.npy_intp))
        self._cache[at] = p
        return p

    def cached(self, int kind, tensor, arg):
        """The plan a call of ``kind`` on ``tensor`` with ``arg`` would find made (the taken
        ones; None when there is none yet, or its signature cannot be one call)."""
        cdef cnp.ndarray x = _array(tensor)
        cdef Py_ssize_t key = -1 if kind == K_ALL_GATHER else (
            <Py_ssize_t><PyObject*>arg if kind < K_BROADCAST else <Py_ssize_t>arg)
        cdef Py_ssize_t at
        if x is None or kind == K_BARRIER:
            return None
        at = self._index(kind, x, key)
        p = None if at < 0 else self._cached(at, kind, x, key)
        return p if p is not None and (<FastPlan>p).taken else None

    cdef object _result(self, FastPlan p, cnp.ndarray x, object out):
        """Where the result goes: a new array, or ``out`` when a step can write it as it is
        (else None: not taken)."""
        cdef cnp.ndarray o
        cdef cnp.PyArray_Descr* d = cnp.PyArray_DESCR(x)
        if out is None:
            Py_INCREF(<object>d)  # PyArray_Empty steals a reference to the dtype
            return PyArray_Empty(p.out_ndim, p.out_dims, d, 0)
        if not cnp.PyArray_CheckExact(out):
            return None
        o = <cnp.ndarray>out
        if (cnp.PyArray_NDIM(o) != p.out_ndim
                or memcmp(cnp.PyArray_DIMS(o), p.out_dims,
                          p.out_ndim * sizeof(cnp.npy_intp)) != 0
                or not cnp.PyArray_IS_C_CONTIGUOUS(o) or not cnp.PyArray_ISWRITEABLE(o)
                or not (cnp.PyArray_DESCR(o) == d
                        or cnp.PyArray_EquivTypes(<cnp.dtype>cnp.PyArray_DESCR(o), <cnp.dtype>d))):
            return None
        return out

    # ------------------------------------------------------------------ one-call paths
    cdef object _fold_now(self, int kind, object tensor, object out, object op, object timeout):
        cdef cnp.ndarray x = _array(tensor)
        cdef FastPlan p
        cdef int rc
        cdef double t, start, soft
        cdef long long seq
        if x is None or not cnp.PyArray_IS_C_CONTIGUOUS(x) or type(op) is not _ReduceOp:
            return _NOT_TAKEN
        p = self._plan(kind, x, op, <Py_ssize_t><PyObject*>op)
        if p is None or not p.taken:
            return _NOT_TAKEN
        res = self._result(p, x, out)
        if res is None:
            return _NOT_TAKEN
        self._enter(p.name, timeout, &t, &seq, &start)
        try:
            soft = start + t * <double>_p2p["STALL_FRACTION"]
            if kind == K_FOLD_FIRST:  # allreduce: split beyond the engine's threshold
                rc = self.api.allreduce(self.api.ctx, p.hptr, p.hlen, p.hash, <uint32_t>seq,
                                        cnp.PyArray_DATA(x), cnp.PyArray_NBYTES(x),
                                        cnp.PyArray_DATA(<cnp.ndarray>res), p.count, p.code,
                                        p.kernel, p.div, soft)
            else:
                rc = self.api.fold(self.api.ctx, p.hptr, p.hlen, p.hash, <uint32_t>seq,
                                   cnp.PyArray_DATA(x), cnp.PyArray_NBYTES(x),
                                   cnp.PyArray_DATA(<cnp.ndarray>res), p.offset, p.count,
                                   p.code, p.kernel, p.div, soft)
            if rc == -1:
                raise ValueError(f"{p.name}: the fold has no kernel for dtype code {p.code}")
            if rc != FERRO_OK:
                self._recover(rc, p.name, seq, t, start)
                rc = self._slots_keep.fold(res, cnp.PyArray_NBYTES(x), p.offset, p.count,
                                           cnp.PyArray_ITEMSIZE(x), p.code, p.kernel, p.div,
                                           start + t)
                if rc != FERRO_OK:  # a split allreduce whose resumed pipeline did not end
                    self._late(rc, p.name, seq, t, start)
        finally:
            self._finish(seq)
        return res

    cdef object _copy_now(self, int kind, object tensor, object out, object arg,
                          Py_ssize_t key, object timeout):
        """broadcast, all_gather, and a gather that fits a slot (one all_gather step under
        the gather's header: only its root returns the blocks, the others None)."""
        cdef cnp.ndarray x = _array(tensor)
        cdef FastPlan p
        cdef int rc
        cdef double t, start, soft
        cdef long long seq
        cdef bint gather = kind == K_GATHER
        cdef bint mine = not gather or self.me == key
        if x is None or not cnp.PyArray_IS_C_CONTIGUOUS(x) or (out is not None and not mine):
            return _NOT_TAKEN
        p = self._plan(kind, x, arg, key)
        if p is None or not p.taken or (gather and not p.one_step):
            return _NOT_TAKEN
        res = self._result(p, x, out)
        if res is None:
            return _NOT_TAKEN
        self._enter(p.name, timeout, &t, &seq, &start)
        try:
            if not p.one_step:
                self._staged(p, x, res, seq, t, start)
                return res
            soft = start + t * <double>_p2p["STALL_FRACTION"]
            rc = self.api.copy(self.api.ctx, p.hptr, p.hlen, p.hash, <uint32_t>seq,
                               cnp.PyArray_DATA(x), cnp.PyArray_NBYTES(x),
                               cnp.PyArray_DATA(<cnp.ndarray>res), p.root, soft)
            if rc != FERRO_OK:
                self._recover(rc, p.name, seq, t, start)
                self._slots_keep.copy(x, res, p.root)
        finally:
            self._finish(seq)
        return res if mine else None

    cdef int _barrier_now(self, object timeout) except -1:
        """The barrier: one engine step with the barrier's header (its hash on the control
        line each rank waits on)."""
        cdef FastPlan p = self._barrier
        cdef int rc
        cdef double t, start, soft
        cdef long long seq
        self._enter("barrier", timeout, &t, &seq, &start)
        try:
            soft = start + t * <double>_p2p["STALL_FRACTION"]
            rc = self.api.barrier(self.api.ctx, p.hptr, p.hlen, p.hash,
                                  <uint32_t>seq, soft)
            if rc != FERRO_OK:
                self._recover(rc, "barrier", seq, t, start)
        finally:
            self._finish(seq)
        return 0


include "_entry.pxi"
