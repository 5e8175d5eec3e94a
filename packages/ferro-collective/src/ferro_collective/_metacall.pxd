# The twin's declarations, for _onecall.pyx (which calls it in C) and _metacall.pyx (which
# defines it).
from libc.stdint cimport int64_t, uint32_t


cdef class Twin:
    cdef object g, comm, steps, engine, backend, _keep, make_step
    cdef bint plain_timeout           # the backend's timeout is Backend's own property
    cdef int n, me
    cdef Py_ssize_t slot_bytes
    cdef bint cma_ok
    cdef char** slots                 # every rank's slot data, by parity: slots[2 * rank + p]
    cdef public long long taken       # the calls this twin ran (for tests and diagnostics)
    # scatter: the headers' templates by root; this rank's last descriptor as a root; the
    # last root descriptor seen, and (dtype, shape) of every rank's block from it
    cdef list _scatter_headers
    cdef object _root_dtype, _root_shape
    cdef bytes _root_desc, _desc_seen
    cdef tuple _block
    # all_to_all_single: the last header's template and its dtype and trailing shape; every
    # rank's last metadata, its row bytes, and the plan from them
    cdef object _a2a_dtype, _a2a_trailing
    cdef bytes _a2a_template, _metas_seen
    cdef Py_ssize_t _rb_seen
    cdef tuple _split

    cdef char* slot(self, int rank, uint32_t step)
    cdef Py_ssize_t _rot(self, uint32_t step, Py_ssize_t off, Py_ssize_t nbytes) except -1
    cdef bint _usable(self, Py_ssize_t off)
    cdef object _timeout(self, object timeout, str name)
    cdef object _step(self, str name, bytes template, object seq, double secs, double start,
                      uint32_t step, Py_ssize_t filled)
    cdef object _turn(self, int kind, str name, double secs, object x, object arg,
                      object out, int64_t* splits)
    cdef object scatter(self, object tensor, int root, object timeout, object out)
    cdef object _scatter(self, object seq, double secs, double start, object xo, int root,
                         bytes desc, object out)
    cdef object all_to_all_single(self, object tensor, object splits, object timeout,
                                  object out)
    cdef object _a2a(self, object seq, double secs, double start, object xo, object unused,
                     object out, int64_t* ints)
    cdef tuple _split_of(self, uint32_t step, Py_ssize_t block, Py_ssize_t rb)
