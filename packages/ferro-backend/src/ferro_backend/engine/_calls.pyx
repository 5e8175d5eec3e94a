# cython: language_level=3
"""The door's collectives for Python: one :class:`Call` per call signature, prepared once.

A :class:`Call` is a collective of ``ferro/engine.h`` with its dtype, op, root and the shape its
header names fixed (as mpi4py's persistent requests fix theirs): each run is the door's call
through its public table (``ferro_engine_api``, the one C and C++ clients call), on raw
addresses (:meth:`Call.run_at`, and :data:`RUN_AT`, the same as a C function for
ferro-collective's compiled path, which holds the arrays) or on buffers (:meth:`Call.run`). A run holds the GIL until the door is about to wait or move much
(its wait hook lets it go there and takes it back), so a call whose peers have arrived costs no
GIL round trip, and other Python threads run while one waits. Ticket :data:`RESERVE` takes the
call's ticket as it is made, under the GIL, so that calls from Python threads keep the order
they were made in (:attr:`Call.ticket` gives it back).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport int64_t
from libc.string cimport memcpy

from ferro.engine cimport *

import sys

cdef extern from "_gil.h":
    # the GIL's wait hook for a door call made with it held (let go while the call waits)
    void ferro_gil_hook(void* ctx, int waiting) noexcept nogil

cdef enum:
    K_BARRIER, K_ALLREDUCE, K_REDUCE, K_REDUCE_SCATTER, K_ALL_GATHER, K_GATHER, K_SCATTER, \
        K_BROADCAST, K_ALL_TO_ALL
#: the door's collectives (a :class:`Call`'s ``kind``)
BARRIER, ALLREDUCE, REDUCE, REDUCE_SCATTER = K_BARRIER, K_ALLREDUCE, K_REDUCE, K_REDUCE_SCATTER
ALL_GATHER, GATHER, SCATTER = K_ALL_GATHER, K_GATHER, K_SCATTER
BROADCAST, ALL_TO_ALL = K_BROADCAST, K_ALL_TO_ALL
#: a run's ticket: reserve one as the call is made
RESERVE = -2
cdef size_t[13] _ITEM_BYTES = [4, 8, 1, 2, 4, 8, 1, 2, 4, 8, 2, 2, 1]  # by ferro_dtype


cdef class Call:
    """A collective of ``comm`` (a ``_comm.Comm``, kept alive while this is) of one signature:
    ``kind`` (:data:`ALLREDUCE`...), ``dtype`` (ferro/engine.h's code), ``op``, ``root``, the
    ``shape`` its header names (a sequence of ints; None: the count) and ``type_name`` (the
    header's element type, numpy's ``dtype.str``, for bytes of a dtype the door does not know;
    None: ``dtype``'s); ``span``: the tickets the client's whole call takes where this is its
    first collective (``ferro_opts.flags``' FERRO_OPTS_SPAN; 0: one); ``names_call`` and
    ``names_op``: the collective and op wire codes its header names instead of its own (0: its
    own; FERRO_OPTS_CALL, FERRO_OPTS_OP: a whole call's first collective names the call)."""

    cdef ferro_comm* c
    cdef const ferro_engine_api* api
    cdef readonly object comm
    cdef int kind, dtype, op, root, n
    cdef size_t item
    cdef bytes _dims, _type_name
    cdef ferro_opts base
    #: the ticket of the last run made with :data:`RESERVE`
    cdef readonly int64_t ticket

    def __init__(self, comm, int kind, int dtype, int op=0, int root=0, shape=None,
                 bytes type_name=None, unsigned int span=0, unsigned int names_call=0,
                 unsigned int names_op=0):
        if not 0 <= kind <= K_ALL_TO_ALL:
            raise ValueError(f"Call: kind {kind} is not one of the door's")
        if not 0 <= dtype < FERRO_DTYPE_COUNT:
            raise ValueError(f"Call: dtype code {dtype} is not one of the door's")
        self.comm, self.c = comm, <ferro_comm*><size_t>comm.comm_address
        self.api = ferro_api(self.c)  # the table, from the communicator (as any client)
        self.kind, self.dtype, self.op, self.root = kind, dtype, op, root
        self.n, self.item = comm.n, _ITEM_BYTES[dtype]
        self._type_name = type_name
        self.base.size = sizeof(ferro_opts)
        if span > 0xFFFF:
            raise ValueError(f"Call: span {span} is more tickets than a header names (65535)")
        if names_call > 0xFF or names_op > 8:
            raise ValueError(f"Call: the header names collective code {names_call} (0-255) "
                             f"and op wire code {names_op} (0-8)")
        # FERRO_OPTS_SPAN: the tickets the client's call takes (0: one); FERRO_OPTS_CALL and
        # FERRO_OPTS_OP: what its header names instead of this collective (0: its own)
        self.base.flags = span | names_call << 16 | names_op << 24
        self.base.timeout = 0.0
        self.base.ticket = FERRO_TICKET_NOW
        self.base.ndim = 0
        self.base.dims = NULL
        self.base.type_name = NULL if type_name is None else <const char*>self._type_name
        self.base.wait_hook = ferro_gil_hook
        self.base.wait_ctx = NULL
        if shape is not None:  # (a scalar's: no dims, but a shape all the same)
            self._dims = b"".join(int(d).to_bytes(8, sys.byteorder, signed=True)
                                  for d in shape)
            self.base.ndim = len(shape)
            self.base.dims = <const int64_t*><const char*>self._dims

    def run_at(self, size_t send, size_t send_bytes, size_t recv, size_t recv_bytes,
               double timeout) -> int:
        """Run on raw addresses (0: NULL) of ``send_bytes`` and ``recv_bytes``, with a ticket
        reserved now (:attr:`ticket`) and ``timeout`` seconds (0: the communicator's
        default): OK, or a status whose message ``_comm.last_error()`` gives."""
        return _run_at(self, <const void*>send, send_bytes, <void*>recv, recv_bytes, timeout)

    def run(self, object send, object recv, int64_t ticket=RESERVE, double timeout=0.0) -> int:
        """Run on buffers (None where a rank passes NULL) with ``ticket`` (:data:`RESERVE`:
        one reserved now; -1: FERRO_TICKET_NOW); as :meth:`run_at` returns."""
        cdef Py_buffer b, o
        cdef bint have_b = send is not None, have_o = recv is not None
        if ticket == RESERVE:
            ticket = self.ticket = self.api.reserve(self.c)
        if have_b:
            PyObject_GetBuffer(send, &b, PyBUF_SIMPLE)
        try:
            if have_o:
                PyObject_GetBuffer(recv, &o, PyBUF_WRITABLE)
            try:
                return self._run(b.buf if have_b else NULL, b.len if have_b else 0,
                                 o.buf if have_o else NULL, o.len if have_o else 0, ticket,
                                 timeout)
            finally:
                if have_o:
                    PyBuffer_Release(&o)
        finally:
            if have_b:
                PyBuffer_Release(&b)

    cdef int _run(self, const void* sp, size_t blen, void* rp, size_t olen, int64_t ticket,
                  double timeout) noexcept:
        """The door call (counts from the byte counts, as ferro/engine.h defines them)."""
        cdef ferro_opts opts
        cdef size_t count
        cdef int kind = self.kind, dtype = self.dtype
        memcpy(&opts, &self.base, sizeof(ferro_opts))
        opts.timeout = timeout
        opts.ticket = ticket
        if kind == K_ALLREDUCE or kind == K_REDUCE or kind == K_GATHER or kind == K_ALL_GATHER:
            count = blen // self.item
        elif kind == K_ALL_TO_ALL:
            count = blen // (self.item * self.n)
        else:
            count = olen // self.item
        # the GIL held until the call waits or moves much (its wait hook lets it go)
        if kind == K_BARRIER:
            return self.api.barrier(self.c, &opts)
        if kind == K_ALLREDUCE:
            return self.api.allreduce(self.c, sp, rp, count, dtype, self.op, &opts)
        if kind == K_REDUCE:
            return self.api.reduce(self.c, sp, rp, count, dtype, self.op, self.root, &opts)
        if kind == K_REDUCE_SCATTER:
            return self.api.reduce_scatter(self.c, sp, rp, count, dtype, self.op, &opts)
        if kind == K_ALL_GATHER:
            return self.api.all_gather(self.c, sp, rp, count, dtype, &opts)
        if kind == K_GATHER:
            return self.api.gather(self.c, sp, rp, count, dtype, self.root, &opts)
        if kind == K_SCATTER:
            return self.api.scatter(self.c, sp, rp, count, dtype, self.root, &opts)
        if kind == K_BROADCAST:
            return self.api.broadcast(self.c, sp, rp, count, dtype, self.root, &opts)
        return self.api.all_to_all(self.c, sp, rp, count, dtype, &opts)


cdef int _run_at(object call, const void* send, size_t send_bytes, void* recv,
                 size_t recv_bytes, double timeout) noexcept:
    """:meth:`Call.run_at` on pointers (``call`` a :class:`Call`, the GIL held)."""
    cdef Call c = <Call>call
    c.ticket = c.api.reserve(c.c)
    return c._run(send, send_bytes, recv, recv_bytes, c.ticket, timeout)


#: :meth:`Call.run_at` as a C function, for compiled callers in other extension modules (the
#: one-call path of ferro-collective), with no Python call and no int objects per call:
#: ``int (*)(PyObject* call, const void* send, size_t send_bytes, void* recv,
#: size_t recv_bytes, double timeout)``, named ``"ferro_backend.engine._calls.RUN_AT"``. The
#: caller holds the GIL and a reference to ``call``, which must be a :class:`Call`.
RUN_AT = PyCapsule_New(<void*>_run_at, b"ferro_backend.engine._calls.RUN_AT", NULL)
