# The object collectives' twin, for _onecall.pyx (which calls it in C).
from ._metacall cimport Twin


cdef object broadcast_object_now(Twin self, object obj, int root, object timeout)
cdef object all_gather_object_now(Twin self, object obj, object timeout)
