# cython: language_level=3
"""The object collectives' twin (:mod:`._metacall`): broadcast_object and all_gather_object in
one call, byte for byte as their general path (:mod:`.objects`' ``prepare_*`` on the engine):
the same header; as each rank's metadata its pickle's size and whether it could be made; the
pickle once in its slot (moving through it from call to call) or, beyond the slot, its address
for every peer (as all_gather_v's blocks, :func:`._exchange_twin.put_block`); and the same
reads. Pickling, unpickling and the errors are :mod:`.pickles`' (the general path's own), run
outside the engine's turn. None for a call it does not take, before a ticket is taken.
"""

from libc.stdint cimport int64_t, uint32_t
from libc.string cimport memset

from cpython.bytes cimport PyBytes_AS_STRING

import numpy as np

from .header import encode
from .metadata_step import payload_offset
from .pickles import broadcast_result, dumps, gathered

from ._exchange_twin cimport put_block, read_pieces
from ._metacall cimport Twin

cdef object _BYTES = np.dtype(np.uint8)
cdef Py_ssize_t _BLOCK = 8 + 16                      # status, then the size and the flag
cdef Py_ssize_t _OFF = payload_offset(8 + 16)
cdef str _BCAST = "broadcast_object", _GATHER = "all_gather_object"
cdef bytes _GATHER_HEADER = encode(_GATHER, None, (), None, -1)
cdef dict _bcast_headers = {}                        # by root


cdef Py_ssize_t _meta(Twin self, uint32_t step, bytes payload, object error) except -1:
    """This rank's status and metadata in its slot of ``step``, its pickle after them (or its
    address); the bytes filled."""
    cdef char* mine = self.slot(self.me, step)
    cdef int64_t* ints = <int64_t*>(mine + 8)
    memset(mine, 0, 8)
    ints[0], ints[1] = len(payload), error is not None
    return _BLOCK + put_block(self, step, _OFF, PyBytes_AS_STRING(payload), len(payload))


# ------------------------------------------------------------------ broadcast_object
cdef object broadcast_object_now(Twin self, object obj, int root, object timeout):
    """:func:`ferro_collective.broadcast_object`'s result in a 1-tuple (the object may be None),
    or None where the general path must run it."""
    if not self.usable(_OFF):
        return None
    secs = self.timeout_of(timeout, _BCAST)
    if secs is None:
        return None
    payload, error = dumps(_BCAST, obj) if self.me == root else (b"", None)
    failed, data = self.turn(_BCAST, secs, _broadcast, payload, root, error, NULL)
    return (broadcast_result(_BCAST, self.me, root, obj, error, failed,
                             payload if self.me == root else data),)


cdef object _broadcast(Twin self, object seq, double secs, double start, object payload,
                       object arg, object error, int64_t* unused):
    """broadcast_object in its turn: the root's pickle's flag and, on the others, its bytes."""
    cdef int n = self.n, me = self.me, root = arg
    cdef uint32_t step = <uint32_t>self.steps.step + 1
    cdef Py_ssize_t filled
    if me == root:
        filled = _meta(self, step, payload, error)
    else:
        memset(self.slot(me, step), 0, _BLOCK)
        filled = _BLOCK
    template = _bcast_headers.get(root)
    if template is None:
        template = _bcast_headers[root] = encode(_BCAST, None, (), None, root)
    call = self.step_meta(_BCAST, template, seq, secs, start, step, filled)
    cdef int64_t* theirs = <int64_t*>(self.slot(root, step) + 8)
    size, failed = theirs[0], theirs[1]
    totals = [0] * n
    totals[root] = size
    rows = [0] * n
    if me != root:
        rows[root] = size
    got = read_pieces(self, _BCAST, seq, secs, start, call, step, _OFF, rows, 1, totals, [0] * n,
                      PyBytes_AS_STRING(payload), _BYTES, (), False)
    return failed, got[root]


# ------------------------------------------------------------------ all_gather_object
cdef object all_gather_object_now(Twin self, object obj, object timeout):
    """:func:`ferro_collective.all_gather_object`, or None where the general path must run
    it."""
    if not self.usable(_OFF):
        return None
    secs = self.timeout_of(timeout, _GATHER)
    if secs is None:
        return None
    payload, error = dumps(_GATHER, obj)
    pieces, failed = self.turn(_GATHER, secs, _all_gather, payload, None, error, NULL)
    return gathered(_GATHER, self.me, pieces, failed, error)


cdef object _all_gather(Twin self, object seq, double secs, double start, object payload,
                        object arg, object error, int64_t* unused):
    """all_gather_object in its turn: every rank's pickle (or reason) and flag."""
    cdef int n = self.n, r
    cdef uint32_t step = <uint32_t>self.steps.step + 1
    call = self.step_meta(_GATHER, _GATHER_HEADER, seq, secs, start, step,
                          _meta(self, step, payload, error))
    sizes = [(<int64_t*>(self.slot(r, step) + 8))[0] for r in range(n)]
    failed = [(<int64_t*>(self.slot(r, step) + 8))[1] for r in range(n)]
    rows = list(sizes)
    rows[self.me] = 0  # (its own pickle is unpickled from where it is: no copy)
    pieces = read_pieces(self, _GATHER, seq, secs, start, call, step, _OFF, rows, 1, sizes,
                         [0] * n, PyBytes_AS_STRING(payload), _BYTES, (), False)
    pieces[self.me] = payload
    return pieces, failed
