# The one-call plan's fields, declared for _onecall (which reads them in C) and _doorplan (which
# makes them).
cimport numpy as cnp

cdef enum:
    MAX_DIMS = 8    # the most dims a one-call plan's input or result has


cdef class DoorPlan:
    cdef readonly str name
    cdef readonly tuple shape        # the input's shape: what the call's header names
    cdef readonly object call        # the door's call of this signature (``_calls.Call``)
    cdef int out_ndim
    cdef cnp.npy_intp out_dims[MAX_DIMS]
    cdef bint taken
    # the key: dtype, shape and argument of the input it was made for
    cdef int kind, ndim
    cdef cnp.npy_intp dims[MAX_DIMS]
    cdef object descr
    cdef Py_ssize_t arg_key


cdef class SeqCounter:
    cdef public long long value
