# The twin's uneven collectives, for _onecall.pyx (which calls them in C).
from ._metacall cimport Twin


cdef object all_to_all_single_now(Twin self, object tensor, object splits, object timeout,
                                  object out)
cdef object all_to_all_now(Twin self, object tensors, object timeout)
cdef object all_gather_v_now(Twin self, object tensor, object timeout)
