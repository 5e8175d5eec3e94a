# The one-call plan's fields, declared for _fastcall (which reads them in C) and _fastplan (which
# makes them).
cimport numpy as cnp
from libc.stdint cimport uint64_t

cdef enum:
    MAX_DIMS = 8    # the most dims a one-call plan's input or result has


cdef class FastPlan:
    cdef readonly str name
    cdef readonly bytes header
    cdef readonly tuple shape
    cdef readonly int root
    cdef readonly object staged
    cdef const unsigned char* hptr
    cdef size_t hlen
    cdef uint64_t hash
    cdef int out_ndim
    cdef cnp.npy_intp out_dims[MAX_DIMS]
    cdef bint taken, one_step
    cdef int code, kernel
    cdef double div
    cdef size_t offset
    cdef Py_ssize_t count
    # the key: dtype, shape and argument of the input it was made for
    cdef int kind, ndim
    cdef cnp.npy_intp dims[MAX_DIMS]
    cdef object descr, arg
    cdef Py_ssize_t arg_key


cdef class SeqCounter:
    cdef public long long value
