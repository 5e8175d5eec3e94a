# cython: language_level=3
"""The one-call paths, compiled: the executor the dispatcher (:mod:`.dispatch`) tries first,
which runs the common case from the Python call to the engine's door with no Python frame in
between.

A collective on a backend with a same-host engine runs whole behind the engine's door
(``ferro/engine.h``: ferro-backend's ``engine._comm.Comm.collective``): the door takes the
call's ticket and turn, runs its steps, and reports a stall, a timeout, a dead peer or a
mismatch. What is left for Python is the array: :class:`Core`, the base of
:class:`~.engine_group.EngineGroup`, finds the input's signature (dtype, shape, op or root) in a
direct-mapped cache of :class:`DoorPlan` (made here, once per signature: the door's dtype code
and op, the result's shape), checks ``out=`` against it (or allocates the result), and calls
the door. A call that is not this case (another type, a strided input, an ``out=`` of another
shape or dtype, a dtype or op the door does not reduce) answers :data:`NOT_TAKEN` before it takes
a ticket, and the general path checks it and names what is wrong; a call the door refuses
becomes ferro's typed error (:meth:`~.engine.EngineGroup._raise`).
"""

from cpython.object cimport PyObject
from cpython.pycapsule cimport PyCapsule_GetPointer
from cpython.ref cimport Py_INCREF
from cpython.weakref cimport PyWeakref_GetObject
from libc.string cimport memcmp, memcpy

cimport numpy as cnp

from copy import copy as _copy
from weakref import ref as _weakref

from . import p2p
from .arguments import fast_array
from .header import dtype_code
from .ops import CODES, OPS, ReduceOp

from ferro_backend import Backend as _Backend
from ferro_backend import engine as _engine
from ferro_backend.kernels import _fold

from ._doorplan cimport MAX_DIMS, DoorPlan
from ._exchange_twin cimport all_gather_v_now, all_to_all_now, all_to_all_single_now
from ._metacall cimport Twin
from ._objects_twin cimport all_gather_object_now, broadcast_object_now

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    # steals a reference to descr (numpy's pxd leaves it out for that reason)
    object PyArray_Empty(int nd, cnp.npy_intp* dims, cnp.PyArray_Descr* descr, int fortran)

#: what a one-call path answers for a call it does not take
NOT_TAKEN = object()
cdef object _NOT_TAKEN = NOT_TAKEN
#: the collectives with a one-call path (a ``dispatch.Collective``'s ``kind``): the door's, and
#: six with a metadata step (their twin, :mod:`._metacall`, :mod:`._exchange_twin`,
#: :mod:`._objects_twin`)
ALLREDUCE, REDUCE_SCATTER, BROADCAST, ALL_GATHER, BARRIER, GATHER = range(6)
SCATTER, ALL_TO_ALL_SINGLE, ALL_TO_ALL, ALL_GATHER_V = 6, 7, 8, 9
BROADCAST_OBJECT, ALL_GATHER_OBJECT = 10, 11
cdef enum:
    K_ALLREDUCE = 0
    K_REDUCE_SCATTER = 1
    K_BROADCAST = 2
    K_ALL_GATHER = 3
    K_BARRIER = 4
    K_GATHER = 5
    K_SCATTER = 6
    K_ALL_TO_ALL_SINGLE = 7
    K_ALL_TO_ALL = 8
    K_ALL_GATHER_V = 9
    K_BROADCAST_OBJECT = 10
    K_ALL_GATHER_OBJECT = 11
    CACHE = 512             # direct-mapped plan cache entries (a power of two)
ctypedef int (*_RunAt)(object, const void*, size_t, void*, size_t, double) noexcept
cdef _RunAt _run_at = NULL
cdef tuple _NAMES = ("allreduce", "reduce_scatter", "broadcast", "all_gather", "barrier",
                     "gather")
if _engine.AVAILABLE:
    from ferro_backend.engine import _calls
    _DOOR = (_calls.ALLREDUCE, _calls.REDUCE_SCATTER, _calls.BROADCAST, _calls.ALL_GATHER,
             _calls.BARRIER, _calls.GATHER)
    _Call = _calls.Call
    # Call.run_at as a C function (no Python call, no int objects per call)
    _run_at = <_RunAt>PyCapsule_GetPointer(_calls.RUN_AT, b"ferro_backend.engine._calls.RUN_AT")
else:  # no engine, no group: the one-call paths never run
    _DOOR, _Call = (-1,) * 6, None
cdef dict _p2p = p2p.__dict__
cdef object _ReduceOp = ReduceOp
cdef dict _CODES = CODES
cdef int _BYTES = _fold.DTYPE_CODES["uint8"]
cdef object _ZERO = 0.0
# the last backend a call found its Core on, and that Core (weak references: a job's backend is
# freed when its user lets it go): a call on the same backend skips two attribute lookups
# (backend.engine.client, a fifth of a barrier's time here). A Core bound anew forgets them.
cdef object _last_backend = None
cdef object _last_core = None


cdef bint _overlaps(int kind, cnp.ndarray x, cnp.ndarray out, int me) noexcept:
    """Whether ``out`` shares bytes with the input ``x`` other than as the door takes them (the
    same buffer; all_gather's and gather's input at this rank's block of ``out``;
    reduce_scatter's ``out`` at this rank's block of ``x``): the door refuses those, so the
    call goes into a new array, copied into ``out`` after it (the result every transport
    gives; an ``out=`` overlapping the input otherwise made the door refuse on this rank
    alone, its peers waiting for it)."""
    cdef char* a = <char*>cnp.PyArray_DATA(x)
    cdef char* b = <char*>cnp.PyArray_DATA(out)
    cdef Py_ssize_t na = cnp.PyArray_NBYTES(x), nb = cnp.PyArray_NBYTES(out)
    if na == 0 or nb == 0 or a + na <= b or b + nb <= a:
        return False
    if kind == K_ALL_GATHER or kind == K_GATHER:
        return a != b + na * me
    if kind == K_REDUCE_SCATTER or kind == K_SCATTER:
        return b != a + nb * me
    return a != b


def overlaps(int kind, cnp.ndarray x, cnp.ndarray out, int me):
    """:func:`_overlaps` for Python (the engine's general path, ``EngineGroup.door``); ``kind``
    one of this module's collective numbers (ALLREDUCE... SCATTER)."""
    return _overlaps(kind, x, out, me)


cdef class Core:
    """The compiled half of :class:`~.engine_group.EngineGroup`: the one-call paths (the order of
    calls is the door's). The two methods a subclass must define, :meth:`_resolve` and
    :meth:`_raise`, are declared here; nothing else is called on ``self`` that this class does
    not define."""

    def _bind(self, backend, comm):
        """Take ``comm`` (the engine's door, ``engine.comm``) and the backend's timeout."""
        global _last_backend, _last_core
        _last_backend = _last_core = None  # (a backend's engine may get a new Core)
        self._comm, self._backend = comm, backend
        self._cache = [None] * CACHE
        self._barrier = DoorPlan("barrier", (), (), _Call(comm, _DOOR[K_BARRIER], 0))
        self.broken = None
        self.n, self.me = comm.n, comm.me
        self._plain_timeout = getattr(type(backend), "timeout", None) is _Backend.timeout
        self._default = None
        self._stall = comm.stall_fraction
        self.twin = None

    def still_broken(self, str name, seq=None):
        """The group's failure (:attr:`broken`, met by an earlier call) as the error of this
        call ``name`` (ticket ``seq`` where known): a new error of its type naming this call
        and rank, the failure's own words after it (every later call raised the one stored
        object, which named the call that met it)."""
        broken = self.broken
        try:
            exc = _copy(broken)
        except Exception:  # (an error its type cannot remake from its message)
            return broken
        where = name if seq is None else f"{name} (seq {seq})"
        exc.args = (f"{where} on rank {self.me}: an earlier call on this group failed: "
                    f"{broken}",)
        return exc

    # ------------------------------------------------------------------ what a subclass gives
    # (EngineGroup, ferro_collective.engine_group: the backend's timeout rules and ferro's errors)
    def _resolve(self, timeout, str name):
        """The call's ``timeout`` (seconds, not None), checked before it takes a ticket; a
        bad one raises, naming ``name``."""
        raise NotImplementedError(f"{type(self).__name__} must define _resolve")

    def _raise(self, int rc, str name, seq, timeout):
        """Raise ferro's error for a door call ``name`` (ticket ``seq``) that returned ``rc``
        after waiting up to ``timeout`` seconds (the door's message is this thread's last)."""
        raise NotImplementedError(f"{type(self).__name__} must define _raise")

    # ------------------------------------------------------------------ a call
    cdef object _timeout(self, str name, object timeout):
        """The call's timeout as the door takes it: 0.0 for the backend's own, which the
        door's default follows (no float made per call)."""
        if timeout is not None:
            return self._resolve(timeout, name)
        if not self._plain_timeout:
            return self._backend.timeout
        t = self._backend._timeout  # Backend's property returns it
        if t is not self._default:
            self._comm.timeout = self._default = t
        return _ZERO

    cdef int _call(self, DoorPlan p, cnp.ndarray send, cnp.ndarray recv,
                   object timeout) except -1:
        """Run ``p``'s collective through the door on ``send`` and ``recv`` (None: this rank
        passes nothing); a refusal raises ferro's error."""
        t = self._timeout(p.name, timeout)
        cdef double stall = <double>_p2p["STALL_FRACTION"]
        if self.broken is not None:
            raise self.still_broken(p.name)
        if stall != self._stall:
            self._comm.stall_fraction = self._stall = stall
        # the ticket taken as the call is made (under the GIL: this process's order of calls)
        cdef int rc = _run_at(p.call, NULL if send is None else cnp.PyArray_DATA(send),
                              0 if send is None else cnp.PyArray_NBYTES(send),
                              NULL if recv is None else cnp.PyArray_DATA(recv),
                              0 if recv is None else cnp.PyArray_NBYTES(recv), <double>t)
        if rc != 0:
            self._raise(rc, p.name, p.call.ticket, self._comm.timeout if t is _ZERO else t)
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

    cdef DoorPlan _cached(self, Py_ssize_t at, int kind, cnp.ndarray x, Py_ssize_t arg_key):
        cdef object slot = self._cache[at]
        cdef DoorPlan p
        cdef int ndim = cnp.PyArray_NDIM(x)
        if slot is None:
            return None
        p = <DoorPlan>slot
        if (p.kind == kind and <PyObject*>p.descr == <PyObject*>cnp.PyArray_DESCR(x)
                and p.arg_key == arg_key and p.ndim == ndim
                and memcmp(p.dims, cnp.PyArray_DIMS(x), ndim * sizeof(cnp.npy_intp)) == 0):
            return p
        return None

    cdef DoorPlan _plan(self, int kind, cnp.ndarray x, object arg, Py_ssize_t arg_key):
        """The plan of the call's signature: cached, or made now."""
        cdef Py_ssize_t at = self._index(kind, x, arg_key)
        cdef DoorPlan p
        if at < 0:
            return None
        p = self._cached(at, kind, x, arg_key)
        if p is not None:
            return p
        p = self._make(kind, x, arg)
        p.kind, p.ndim, p.descr = kind, cnp.PyArray_NDIM(x), <object>cnp.PyArray_DESCR(x)
        p.arg_key = arg_key
        memcpy(p.dims, cnp.PyArray_DIMS(x), p.ndim * sizeof(cnp.npy_intp))
        self._cache[at] = p
        return p

    cdef DoorPlan _make(self, int kind, cnp.ndarray x, object arg):
        """A signature's plan: the door's dtype code (bytes, naming the dtype, for a copy of a
        dtype it does not know), op or root, and the result's shape."""
        cdef object o = x
        dtype, shape, n = o.dtype, tuple(o.shape), self.n
        code = _CODES.get(dtype)
        if kind <= K_REDUCE_SCATTER:
            op = OPS[arg].door
            if code is None or not _fold.op_fits(code, op):
                return DoorPlan.not_taken()
            call = _Call(self._comm, _DOOR[kind], code, op, 0, shape)
            if kind == K_ALLREDUCE:
                return DoorPlan(_NAMES[kind], shape, shape, call)
            if not shape or shape[0] % n:
                return DoorPlan.not_taken()
            return DoorPlan(_NAMES[kind], shape, (shape[0] // n, *shape[1:]), call)
        if dtype.hasobject or dtype.itemsize == 0:
            return DoorPlan.not_taken()
        name = None if code is not None else dtype_code(dtype)
        if kind == K_BROADCAST:
            out = shape
        else:
            out = (n,) if not shape else (shape[0] * n, *shape[1:])
        call = _Call(self._comm, _DOOR[kind], _BYTES if code is None else code, 0,
                     arg if kind != K_ALL_GATHER else 0, shape, name,
                     arg if kind == K_ALL_GATHER else 0)  # (all_gather's arg: its span)
        return DoorPlan(_NAMES[kind], shape, out, call)

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
        return p if p is not None and (<DoorPlan>p).taken else None

    cdef object _result(self, DoorPlan p, cnp.ndarray x, object out):
        """Where the result goes: a new array, or ``out`` when the door can write it as it is
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

    cdef object _through_new(self, DoorPlan p, object send, cnp.ndarray x, object out,
                             object timeout):
        """The call into a new array, then copied into ``out`` (which shares bytes with the
        input otherwise than the door takes them: :func:`_overlaps`); returns ``out``."""
        res = self._result(p, x, None)
        self._call(p, send, <cnp.ndarray>res, timeout)
        cnp.PyArray_CopyInto(<cnp.ndarray>out, <cnp.ndarray>res)
        return out

    # ------------------------------------------------------------------ one-call paths
    cdef object _fold_now(self, int kind, object tensor, object out, object op, object timeout):
        """allreduce and reduce_scatter."""
        cdef cnp.ndarray x = _array(tensor)
        cdef DoorPlan p
        if x is None or not cnp.PyArray_IS_C_CONTIGUOUS(x) or type(op) is not _ReduceOp:
            return _NOT_TAKEN
        p = self._plan(kind, x, op, <Py_ssize_t><PyObject*>op)
        if p is None or not p.taken:
            return _NOT_TAKEN
        res = self._result(p, x, out)
        if res is None:
            return _NOT_TAKEN
        if res is out and _overlaps(kind, x, <cnp.ndarray>res, self.me):
            return self._through_new(p, x, x, out, timeout)
        self._call(p, x, <cnp.ndarray>res, timeout)
        return res

    cdef object _copy_now(self, int kind, object tensor, object out, object arg,
                          Py_ssize_t key, object timeout):
        """broadcast, all_gather, and gather (only its root returns the blocks, the others
        None)."""
        cdef cnp.ndarray x = _array(tensor)
        cdef DoorPlan p
        cdef bint gather = kind == K_GATHER
        cdef bint mine = not gather or self.me == key
        if x is None or not cnp.PyArray_IS_C_CONTIGUOUS(x) or (out is not None and not mine):
            return _NOT_TAKEN
        p = self._plan(kind, x, arg, key)
        if p is None or not p.taken:
            return _NOT_TAKEN
        res = self._result(p, x, out) if mine else None
        if mine and res is None:
            return _NOT_TAKEN
        send = None if kind == K_BROADCAST and self.me != key else x
        if send is not None and res is out and res is not None \
                and _overlaps(kind, x, <cnp.ndarray>res, self.me):
            return self._through_new(p, send, x, out, timeout)
        self._call(p, send, None if res is None else <cnp.ndarray>res, timeout)
        return res

    cdef int _barrier_now(self, object timeout) except -1:
        return self._call(self._barrier, None, None, timeout)


cdef inline Core _core_of(object backend):
    """``backend``'s engine's Core (the last one found, or looked up now), or None: no engine,
    or no group yet (the general path makes it)."""
    global _last_backend, _last_core
    if _last_backend is not None and PyWeakref_GetObject(_last_backend) == <PyObject*>backend:
        last = <object>PyWeakref_GetObject(_last_core)  # (None once that Core is gone)
        if last is not None:
            return <Core>last
    engine = getattr(backend, "engine", None)
    if engine is None:
        return None
    client = engine.client
    if not isinstance(client, Core):
        return None
    _last_backend, _last_core = _weakref(backend), _weakref(client)
    return <Core>client


cdef bint barrier_now(object backend, object timeout) except -1:
    """A barrier whole on ``backend``'s engine door (True), or False (not taken: no engine, or
    no group yet): :func:`one_call` of :data:`BARRIER`, without its choice of kind."""
    cdef Core c = _core_of(backend)
    if c is None:
        return False
    c._barrier_now(timeout)
    return True


cdef object one_call(int kind, object tensor, object backend, object arg, object timeout,
                     object out, unsigned int span):
    """Run a call of ``kind`` (``arg``: its op or root) whole on ``backend``'s engine door, or
    :data:`NOT_TAKEN`: no engine, no group yet (the general path makes it), or not the case.
    ``span``: what its header says the caller's whole call takes (:class:`~.plan.Plan`'s; a
    compressed call's decider, an all_gather or all_to_all_single; 0 for any other)."""
    cdef Core c = _core_of(backend)
    if c is None or (span and kind != K_ALL_GATHER and kind != K_ALL_TO_ALL_SINGLE):
        return _NOT_TAKEN
    if kind <= K_REDUCE_SCATTER:
        return c._fold_now(kind, tensor, out, arg, timeout)
    if kind == K_BROADCAST:
        if type(arg) is not int or not 0 <= arg < c.n:
            return _NOT_TAKEN
        return c._copy_now(K_BROADCAST, tensor, out, arg, <Py_ssize_t>arg, timeout)
    if kind == K_ALL_GATHER:  # (a span: a plan of its own, its Call's header saying so)
        return c._copy_now(K_ALL_GATHER, tensor, out, span, -1 - <Py_ssize_t>span, timeout)
    if kind == K_GATHER:
        if type(arg) is not int or not 0 <= arg < c.n:
            return _NOT_TAKEN
        return c._copy_now(K_GATHER, tensor, out, arg, <Py_ssize_t>arg, timeout)
    if kind >= K_SCATTER:
        if c.twin is None:  # (its subclass makes one)
            return _NOT_TAKEN
        if kind == K_SCATTER or kind == K_BROADCAST_OBJECT:
            if type(arg) is not int or not 0 <= arg < c.n:
                return _NOT_TAKEN
            if kind == K_BROADCAST_OBJECT:  # (a 1-tuple: the object may be None)
                got = broadcast_object_now(<Twin>c.twin, tensor, arg, timeout)
                return _NOT_TAKEN if got is None else got[0]
            got = (<Twin>c.twin).scatter(tensor, arg, timeout, out)
        elif kind == K_ALL_TO_ALL_SINGLE:
            got = all_to_all_single_now(<Twin>c.twin, tensor, arg, timeout, out, span)
        elif kind == K_ALL_TO_ALL:
            got = all_to_all_now(<Twin>c.twin, tensor, timeout)
        elif kind == K_ALL_GATHER_V:
            got = all_gather_v_now(<Twin>c.twin, tensor, timeout)
        else:
            got = all_gather_object_now(<Twin>c.twin, tensor, timeout)
        return _NOT_TAKEN if got is None else got
    c._barrier_now(timeout)
    return None


cdef inline cnp.ndarray _array(object tensor):
    """``tensor`` when it is an ndarray (a Python or numpy scalar as a 0-d array), else None."""
    if cnp.PyArray_CheckExact(tensor):
        return <cnp.ndarray>tensor
    x = fast_array(tensor)
    return None if x is None else <cnp.ndarray>x
