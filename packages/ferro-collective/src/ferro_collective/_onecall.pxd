# The one-call paths' declarations, for the dispatcher (dispatch.pyx), which cimports one_call
# (a C call, no Python frame), and for _onecall.pyx, which defines them.
cimport numpy as cnp

from ._doorplan cimport DoorPlan


cdef class Core:
    cdef object __weakref__           # (the dispatcher's last-backend cache holds it weakly)
    cdef object _comm, _backend
    cdef list _cache
    cdef DoorPlan _barrier
    cdef public object broken         # the error that broke the group, or None
    cdef public int n, me
    cdef bint _plain_timeout
    cdef object _default      # the backend's timeout the door's default was last set to
    cdef double _stall
    cdef public object twin    # scatter's and the all-to-alls' one-call path (_metacall.Twin)

    cdef object _timeout(self, str name, object timeout)
    cdef int _call(self, DoorPlan p, cnp.ndarray send, cnp.ndarray recv,
                   object timeout) except -1
    cdef Py_ssize_t _index(self, int kind, cnp.ndarray x, Py_ssize_t arg_key)
    cdef DoorPlan _cached(self, Py_ssize_t at, int kind, cnp.ndarray x, Py_ssize_t arg_key)
    cdef DoorPlan _plan(self, int kind, cnp.ndarray x, object arg, Py_ssize_t arg_key)
    cdef DoorPlan _make(self, int kind, cnp.ndarray x, object arg)
    cdef object _result(self, DoorPlan p, cnp.ndarray x, object out)
    cdef object _through_new(self, DoorPlan p, object send, cnp.ndarray x, object out,
                             object timeout)
    cdef object _fold_now(self, int kind, object tensor, object out, object op, object timeout)
    cdef object _copy_now(self, int kind, object tensor, object out, object arg,
                          Py_ssize_t key, object timeout)
    cdef int _barrier_now(self, object timeout) except -1


# a call of ``kind`` whole on the backend's engine door, or NOT_TAKEN
cdef object one_call(int kind, object tensor, object backend, object arg, object timeout,
                     object out, unsigned int span)
# a barrier whole on the backend's engine door (True), or False: not taken
cdef bint barrier_now(object backend, object timeout) except -1
