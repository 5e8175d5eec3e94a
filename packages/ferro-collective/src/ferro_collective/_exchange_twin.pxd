# The twin's uneven collectives, for _onecall.pyx (which calls them in C).
from ._metacall cimport Twin


cdef object all_to_all_single_now(Twin self, object tensor, object splits, object timeout,
                                  object out, unsigned int span)
cdef object all_to_all_now(Twin self, object tensors, object timeout)
cdef object all_gather_v_now(Twin self, object tensor, object timeout)
# (and for the object collectives' twin, _objects_twin.pyx: their pickles move as all_gather_v's
# blocks do)
from libc.stdint cimport uint32_t


cdef Py_ssize_t put_block(Twin self, uint32_t step, Py_ssize_t off, char* data,
                          Py_ssize_t nbytes) except -1
cdef object read_pieces(Twin self, str name, object seq, double secs, double start, object call,
                        uint32_t step, Py_ssize_t off, list rows, Py_ssize_t rb, list totals,
                        list starts, char* own, object dtype, tuple trailing, bint zero_d)
