# cython: language_level=3
"""The twin's uneven collectives (:mod:`._metacall`): all_to_all_single, all_to_all (its list
form) and all_gather_v in one call, on the twin's steps, byte for byte as their general path
(:mod:`.exchange`'s ``prepare_*``): the same header, every rank's row counts as its metadata,
its pieces for the others in its slot (moving through it from call to call) or their
addresses beyond it, and the same reads. None for a call
it does not take, before a ticket is taken: the general path then runs and checks it.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memset

cimport numpy as cnp

import numpy as np

from .arguments import check_out, check_out_known, deliver
from .header import encode
from .metadata_sizes import row_views, split_plan
from .metadata_step import guard, payload_offset

from ._metacall cimport Twin, fast_out, overlap, plain_array

cnp.import_array()

cdef object _EMPTY = np.empty
cdef object _BYTES = np.dtype(np.uint8)
cdef Py_ssize_t _AGV_OFF = payload_offset(16)         # all_gather_v: status + its rows


cdef Py_ssize_t _ints_into(object values, int n, int64_t* into):
    """``values`` (a list or tuple of ``n`` non-negative ints) into ``into``; their sum, or -1
    where they are anything else (the general path then checks them)."""
    cdef Py_ssize_t total = 0, i
    cdef object v
    if not (type(values) is list or type(values) is tuple) or len(values) != n:
        return -1
    for i in range(n):
        v = values[i]
        if type(v) is not int or v < 0:
            return -1
        into[i] = v
        total += into[i]
    return total


cdef bytes _template(Twin self, str name, object dtype, tuple shape):
    """The header's template of ``name`` on ``dtype`` and ``shape`` (the last one's again)."""
    key = (name, dtype, dtype.str, shape)  # (numpy: M8[1000ns] == M8[us], not back)
    if key != self.a2a_key:
        self.a2a_template, self.a2a_key = encode(name, dtype, shape, None, -1), key
    return self.a2a_template


cdef tuple _views(list rows, Py_ssize_t rb, object dtype, tuple trailing, bint zero_d):
    """A new buffer for ``rows[r]`` rows of ``rb`` bytes from each rank, and the result's
    arrays on it, one per rank (:func:`.metadata_sizes.row_views`)."""
    buf = _EMPTY(sum(rows) * rb, _BYTES)
    return buf, row_views(buf, rows, dtype, trailing, zero_d)


cdef object read_pieces(Twin self, str name, object seq, double secs, double start, object call,
                        uint32_t step, Py_ssize_t off, list rows, Py_ssize_t rb, list totals,
                        list starts, char* own, object dtype, tuple trailing, bint zero_d):
    """After the metadata step of all_to_all, all_gather_v or an object collective:
    ``rows[r]`` rows of ``rb`` bytes from each rank ``r``, who sent ``totals[r]`` bytes in all
    (this rank's piece at ``starts[r]`` of them) in its slot or, beyond it, from its memory;
    this rank's own from ``own``. The result's arrays, one per rank
    (``metadata_step.get_pieces``'s reads)."""
    cdef int n = self.n, me = self.me, i, r
    cdef Py_ssize_t room = self.slot_bytes - off, at = 0, k
    cdef char* theirs
    cdef char* dst
    cdef bint direct = False
    buf, result = _views(rows, rb, dtype, trailing, zero_d)
    dst = <char*>cnp.PyArray_DATA(<cnp.ndarray>buf)
    for r in range(me):
        at += <Py_ssize_t>rows[r] * rb
    memcpy(dst + at, own, <Py_ssize_t>rows[me] * rb)
    for i in range(1, n):  # rank me+1 first: the ranks read different peers at once
        r = (me + i) % n
        at = 0 if r == 0 else at + <Py_ssize_t>rows[r - 1] * rb
        k = <Py_ssize_t>rows[r] * rb
        if not k:
            continue
        theirs = self.slot(r, step) + off
        if <Py_ssize_t>totals[r] <= room:
            memcpy(dst + at, theirs + self.rot(step, off, totals[r]) + <Py_ssize_t>starts[r], k)
        else:
            self.g.read(r, (<uint64_t*>theirs)[me], buf[at:at + k])
    for r in range(n):
        if <Py_ssize_t>totals[r] > room:
            direct = True
    if direct:  # nobody reads our memory any more
        self.g.sync(call if call is not None else self.make_step(name, seq, secs, start))
    return result


# ------------------------------------------------------------------ all_to_all_single
cdef object all_to_all_single_now(Twin self, object tensor, object splits, object timeout,
                                  object out, unsigned int span):
    """:func:`ferro_collective.all_to_all_single`, or None where the general path must
    run it (``span``: its header's, :class:`~.plan.Plan`'s)."""
    cdef cnp.ndarray x
    cdef int n = self.n, d
    cdef int64_t* ints
    cdef Py_ssize_t rows
    if not plain_array(tensor) or (out is not None and not cnp.PyArray_Check(out)) \
            or type(splits) is not tuple or len(splits) != 2 \
            or not self.usable(self.a2a_single_off):
        return None
    x = <cnp.ndarray>tensor
    if x.ndim == 0 or x.descr.hasobject or x.itemsize == 0:
        return None
    secs = self.timeout_of(timeout, "all_to_all_single")
    if secs is None:
        return None
    # this call's splits (send, then recv: its metadata) for its own use: the GIL is let go
    # while the call waits, and another thread's call may run the twin meanwhile
    ints = <int64_t*>malloc(2 * n * sizeof(int64_t))
    if ints == NULL:
        raise MemoryError()
    try:
        rows = x.shape[0]
        if splits[0] is None:
            if rows % n:
                return None
            for d in range(n):
                ints[d] = rows // n
        elif _ints_into(splits[0], n, ints) != rows:
            return None
        if splits[1] is None:
            for d in range(n):
                ints[n + d] = -1
            got = -1
        else:
            got = _ints_into(splits[1], n, ints + n)
            if got < 0:
                return None
        if out is not None and guard(lambda: check_out_known(
                "all_to_all_single", out, (got, *(<object>x).shape[1:]), x.dtype))[1] is not None:
            return None  # (a bad out= the general path refuses, on every rank)
        return self.turn("all_to_all_single", secs, _a2a_single, x, span, out, ints)
    finally:
        free(ints)


cdef object _a2a_single(Twin self, object seq, double secs, double start, object xo,
                        object span, object out, int64_t* ints):
    """all_to_all_single in its turn (``ints``: this rank's send, then recv splits; ``span``:
    its header's)."""
    cdef cnp.ndarray x = xo
    cdef int n = self.n, me = self.me, d, i, r
    cdef Py_ssize_t block = 8 + 16 * n, off = self.a2a_single_off
    cdef Py_ssize_t room = self.slot_bytes - off
    cdef uint32_t step = <uint32_t>self.steps.step + 1
    cdef char* mine = self.slot(me, step)
    cdef char* pay = mine + off
    cdef char* data = <char*>cnp.PyArray_DATA(x)
    cdef Py_ssize_t rb = x.itemsize, total = 0, pos = 0, k, at, mine_at = 0, mine_k
    cdef char* dst
    cdef bint direct = False
    dtype, shape = (<object>x).dtype, (<object>x).shape
    trailing = shape[1:]
    for k in trailing:
        rb *= k
    # this rank's metadata (its splits), then its pieces for the others, or their addresses
    memset(mine, 0, 8)
    memcpy(mine + 8, ints, 16 * n)
    for d in range(n):
        if d == me:
            mine_at = total
        total += ints[d] * rb
    mine_k = ints[me] * rb
    if total - mine_k <= room:
        at = 0
        pay += self.rot(step, off, total - mine_k)
        for d in range(n):
            k = ints[d] * rb
            if d != me and k:
                memcpy(pay + pos, data + at, k)
                pos += k
            at += k
    else:
        at = 0
        for d in range(n):
            (<uint64_t*>pay)[d] = <uint64_t><size_t>(data + at)
            at += ints[d] * rb
    call = self.step_meta("all_to_all_single",
                          _template(self, "all_to_all_single", dtype, (-1, *trailing)), seq,
                          secs, start, step, block + pos, <uint16_t>span)
    got, totals, at_peer = _split_of(self, step, block, rb)
    # the result: out as it is, or a new array (a bad out still takes part, then raises;
    # one that overlaps the input is filled at the end)
    shape = (sum(got), *trailing)
    late = None
    res = None if out is None else fast_out(out, shape, dtype)
    if out is not None and res is None:
        _, late = guard(lambda: check_out("all_to_all_single", out, shape, dtype))
    if res is None or overlap(<char*>cnp.PyArray_DATA(<cnp.ndarray>res),
                              cnp.PyArray_NBYTES(<cnp.ndarray>res), data,
                              cnp.PyArray_NBYTES(x)):
        res = _EMPTY(shape, dtype)
    dst = <char*>cnp.PyArray_DATA(<cnp.ndarray>res)
    at = 0
    for r in range(me):
        at += <Py_ssize_t>got[r] * rb
    memcpy(dst + at, data + mine_at, mine_k)  # this rank's own piece
    flat = None
    for i in range(1, n):  # rank me+1 first: the ranks read different peers at once
        r = (me + i) % n
        k = <Py_ssize_t>got[r] * rb
        if r == 0:
            at = 0
        else:
            at += <Py_ssize_t>got[r - 1] * rb
        if not k:
            continue
        if <Py_ssize_t>totals[r] <= room:
            memcpy(dst + at, self.slot(r, step) + off + self.rot(step, off, totals[r])
                   + <Py_ssize_t>at_peer[r], k)
        else:
            direct = True
            if flat is None:
                flat = res.reshape(-1).view(np.uint8)
            self.g.read(r, (<uint64_t*>(self.slot(r, step) + off))[me], flat[at:at + k])
    for r in range(n):
        if <Py_ssize_t>totals[r] > room:
            direct = True
    if direct:  # nobody reads our memory any more
        self.g.sync(call if call is not None else
                    self.make_step("all_to_all_single", seq, secs, start))
    if late is not None or (out is not None and res is not out):
        return deliver(res, out, late)
    return res


cdef tuple _split_of(Twin self, uint32_t step, Py_ssize_t block, Py_ssize_t rb):
    """The rows every rank sends this rank, and the engine's byte sizes, from every rank's
    metadata (:func:`.metadata_sizes.split_plan`, which also makes the split checks every
    rank makes alike); the last one's again when the metadata is the same."""
    cdef int n = self.n, r
    cdef Py_ssize_t each = block - 8
    cdef bint same = self.metas_seen is not None and rb == self.rb_seen
    if same:
        for r in range(n):
            if memcmp(self.slot(r, step) + 8, PyBytes_AS_STRING(self.metas_seen) + r * each,
                      each) != 0:
                same = False
                break
    if same:
        return self.split
    metas = [PyBytes_FromStringAndSize(self.slot(r, step) + 8, each) for r in range(n)]
    split = split_plan("all_to_all_single", metas, n, self.me, rb)
    self.split, self.metas_seen, self.rb_seen = split, b"".join(metas), rb
    return split


# ------------------------------------------------------------------ all_to_all
cdef object all_to_all_now(Twin self, object tensors, object timeout):
    """:func:`ferro_collective.all_to_all`, or None where the general path must run it."""
    cdef int n = self.n, d
    cdef cnp.ndarray t
    cdef int64_t* ints
    cdef bint zero_d
    if not (type(tensors) is list or type(tensors) is tuple) or len(tensors) != n \
            or not self.usable(self.a2a_off):
        return None
    xs = tuple(tensors)
    for d in range(n):
        if not plain_array(xs[d]):
            return None
    t = <cnp.ndarray>xs[0]
    dtype, zero_d, trailing = (<object>t).dtype, t.ndim == 0, (<object>t).shape[1:]
    if t.descr.hasobject or t.itemsize == 0:
        return None
    for d in range(1, n):
        t = <cnp.ndarray>xs[d]
        if (<object>t).dtype != dtype or (t.ndim == 0) != zero_d \
                or (<object>t).shape[1:] != trailing:
            return None
    secs = self.timeout_of(timeout, "all_to_all")
    if secs is None:
        return None
    ints = <int64_t*>malloc(n * sizeof(int64_t))  # this call's own (see all_to_all_single)
    if ints == NULL:
        raise MemoryError()
    try:
        for d in range(n):
            ints[d] = 1 if zero_d else (<cnp.ndarray>xs[d]).shape[0]
        return self.turn("all_to_all", secs, _a2a_list, xs, (dtype, trailing, zero_d), None,
                         ints)
    finally:
        free(ints)


cdef object _a2a_list(Twin self, object seq, double secs, double start, object xs, object arg,
                      object unused, int64_t* ints):
    """all_to_all in its turn (``ints``: the rows this rank sends each rank)."""
    cdef int n = self.n, me = self.me, d, r
    cdef Py_ssize_t block = 8 + 8 * n, off = self.a2a_off
    cdef Py_ssize_t room = self.slot_bytes - off
    cdef uint32_t step = <uint32_t>self.steps.step + 1
    cdef char* mine = self.slot(me, step)
    cdef char* pay
    cdef int64_t* row
    cdef Py_ssize_t rb, total = 0, k, at, part
    dtype, trailing, zero_d = arg
    rb = (<cnp.dtype>dtype).itemsize
    for k in trailing:
        rb *= k
    # this rank's rows (its metadata), then its pieces for the others, or their addresses
    memset(mine, 0, 8)
    memcpy(mine + 8, ints, 8 * n)
    for d in range(n):
        if d != me:
            total += ints[d] * rb
    if total <= room:
        pay = mine + off + self.rot(step, off, total)
        at = 0
        for d in range(n):
            k = ints[d] * rb
            if d != me and k:
                memcpy(pay + at, cnp.PyArray_DATA(<cnp.ndarray>xs[d]), k)
                at += k
    else:
        total = 0
        for d in range(n):
            (<uint64_t*>(mine + off))[d] = <uint64_t><size_t>cnp.PyArray_DATA(<cnp.ndarray>xs[d])
    call = self.step_meta("all_to_all", _template(self, "all_to_all", dtype,
                                                  () if zero_d else (-1, *trailing)),
                          seq, secs, start, step, block + total)
    # what each rank sends this one: its rows, and where they sit among all it sends
    rows, totals, starts = [], [], []
    for r in range(n):
        row = <int64_t*>(self.slot(r, step) + 8)
        total, part = 0, 0
        for d in range(n):
            total += row[d] * rb
            if d < me:
                part += row[d] * rb
        rows.append(row[me])
        totals.append(total - row[r] * rb)
        starts.append(part - (row[r] * rb if r < me else 0))
    return read_pieces(self, "all_to_all", seq, secs, start, call, step, off, rows, rb, totals,
                       starts, <char*>cnp.PyArray_DATA(<cnp.ndarray>xs[me]), dtype, trailing,
                       zero_d)


# ------------------------------------------------------------------ all_gather_v
cdef Py_ssize_t put_block(Twin self, uint32_t step, Py_ssize_t off, char* data,
                          Py_ssize_t nbytes) except -1:
    """:func:`.metadata_step.put_block`: this rank's ``nbytes`` at ``data`` (the same for every
    peer) once into its slot of ``step`` after the metadata (at ``off``), moving through it, or
    beyond the slot's room its address for every peer. Returns the bytes put in the slot."""
    cdef char* mine = self.slot(self.me, step)
    cdef int d
    if nbytes <= self.slot_bytes - off:
        memcpy(mine + off + self.rot(step, off, nbytes), data, nbytes)
        return nbytes
    for d in range(self.n):
        (<uint64_t*>(mine + off))[d] = <uint64_t><size_t>data
    return 0


cdef object all_gather_v_now(Twin self, object tensor, object timeout):
    """:func:`ferro_collective.all_gather_v`, or None where the general path must run it."""
    cdef cnp.ndarray x
    cdef int64_t rows
    if not plain_array(tensor) or not self.usable(_AGV_OFF):
        return None
    x = <cnp.ndarray>tensor
    if x.descr.hasobject or x.itemsize == 0:
        return None
    secs = self.timeout_of(timeout, "all_gather_v")
    if secs is None:
        return None
    rows = 1 if x.ndim == 0 else x.shape[0]
    return self.turn("all_gather_v", secs, _agv, x, None, None, &rows)


cdef object _agv(Twin self, object seq, double secs, double start, object xo, object arg,
                 object unused, int64_t* ints):
    """all_gather_v in its turn (``ints``: this rank's rows): its block rides in its slot once,
    or its address for every peer (``metadata_step.put_block``)."""
    cdef cnp.ndarray x = xo
    cdef int n = self.n, me = self.me, r
    cdef Py_ssize_t off = _AGV_OFF
    cdef uint32_t step = <uint32_t>self.steps.step + 1
    cdef char* mine = self.slot(me, step)
    cdef char* data = <char*>cnp.PyArray_DATA(x)
    cdef Py_ssize_t nbytes = cnp.PyArray_NBYTES(x), filled, rb, k
    dtype, zero_d, trailing = (<object>x).dtype, x.ndim == 0, (<object>x).shape[1:]
    rb = x.itemsize
    for k in trailing:
        rb *= k
    memset(mine, 0, 8)
    memcpy(mine + 8, ints, 8)
    filled = put_block(self, step, off, data, nbytes)
    call = self.step_meta("all_gather_v", _template(self, "all_gather_v", dtype,
                                                    () if zero_d else (-1, *trailing)),
                          seq, secs, start, step, 16 + filled)
    rows = [(<int64_t*>(self.slot(r, step) + 8))[0] for r in range(n)]
    return read_pieces(self, "all_gather_v", seq, secs, start, call, step, off, rows, rb,
                       [k * rb for k in rows], [0] * n, data, dtype, trailing, zero_d)
