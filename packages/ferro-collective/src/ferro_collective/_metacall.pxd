# The twin's declarations, for _onecall.pyx (which calls it in C), _exchange_twin.pyx (the
# all-to-alls, on the twin's steps) and _metacall.pyx (which defines it).
from libc.stdint cimport int64_t, uint16_t, uint32_t

cdef class Twin

# a call's part in its ticket's turn (Twin._turn runs it): its own arguments x, arg, out, ints
ctypedef object (*TurnBody)(Twin t, object seq, double secs, double start, object x,
                            object arg, object out, int64_t* ints)


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
    # the all-to-alls (_exchange_twin): the last header's key and template; every rank's last
    # metadata, its row bytes, and the plan from them (all_to_all_single)
    cdef Py_ssize_t a2a_single_off, a2a_off  # where their payload starts (payload_offset)
    cdef object a2a_key
    cdef bytes a2a_template, metas_seen
    cdef Py_ssize_t rb_seen
    cdef tuple split

    cdef char* slot(self, int rank, uint32_t step)
    cdef Py_ssize_t rot(self, uint32_t step, Py_ssize_t off, Py_ssize_t nbytes) except -1
    cdef bint usable(self, Py_ssize_t off)
    cdef object timeout_of(self, object timeout, str name)
    cdef object step_meta(self, str name, bytes template, object seq, double secs,
                          double start, uint32_t step, Py_ssize_t filled, uint16_t span=*)
    cdef object turn(self, str name, double secs, TurnBody body, object x, object arg,
                     object out, int64_t* ints)
    cdef object scatter(self, object tensor, int root, object timeout, object out)


cdef double now() noexcept nogil
cdef bint overlap(char* a, Py_ssize_t na, char* b, Py_ssize_t nb) noexcept
cdef bint plain_array(object x)
cdef object fast_out(object out, tuple shape, object dtype)
