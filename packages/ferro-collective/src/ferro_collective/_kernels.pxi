# The reduction loops shared by ``_reduce.pyx`` (the kernels numpy arrays call) and
# ``_shmcoll.pyx`` (the engine's one-call collectives, which fold slots by address): included
# textually by both, so one definition serves both modules.

cimport cython
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

ctypedef fused num:
    float
    double
    int8_t
    int16_t
    int32_t
    int64_t
    uint8_t
    uint16_t
    uint32_t
    uint64_t

ctypedef fused real:
    float
    double

# the op codes (exported by _reduce as OP_*, so that ops.py reads them from one definition)
cdef enum:
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    BAND = 4
    BOR = 5
    BXOR = 6

# the dtype codes of fold_raw (exported by _reduce as DTYPE_CODES)
cdef enum:
    F32 = 0
    F64 = 1
    I8 = 2
    I16 = 3
    I32 = 4
    I64 = 5
    U8 = 6
    U16 = 7
    U32 = 8
    U64 = 9


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _acc(num* acc, const num* x, Py_ssize_t n, int op) noexcept nogil:
    cdef Py_ssize_t i
    if op == SUM:
        for i in range(n):
            acc[i] = acc[i] + x[i]
    elif op == PROD:
        for i in range(n):
            acc[i] = acc[i] * x[i]
    elif op == MAX:
        # NaN propagates like np.maximum: a NaN in either operand wins
        for i in range(n):
            if not (acc[i] >= x[i]):
                if num is float or num is double:
                    if acc[i] != acc[i]:
                        continue
                acc[i] = x[i]
    elif op == MIN:
        for i in range(n):
            if not (acc[i] <= x[i]):
                if num is float or num is double:
                    if acc[i] != acc[i]:
                        continue
                acc[i] = x[i]
    elif num is not float and num is not double:  # the bitwise ops: integers only
        if op == BAND:
            for i in range(n):
                acc[i] = acc[i] & x[i]
        elif op == BOR:
            for i in range(n):
                acc[i] = acc[i] | x[i]
        elif op == BXOR:
            for i in range(n):
                acc[i] = acc[i] ^ x[i]


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _acc_div(real* acc, const real* x, Py_ssize_t n, real d) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        acc[i] = (acc[i] + x[i]) / d


#: elements per block of a fold: the block of the output stays in cache while every input is
#: folded into it
cdef Py_ssize_t FOLD_BLOCK = 4096


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _fold(num* out, const num** ptrs, Py_ssize_t count, Py_ssize_t n, int op,
                double mean_divisor) noexcept nogil:
    """``out = ptrs[0] op ptrs[1] op ... op ptrs[count - 1]`` (``n`` items each), in that
    order, block by block; with ``mean_divisor`` > 0 the last step also divides (MEAN)."""
    cdef Py_ssize_t start = 0, size, j
    while start < n:
        size = min(FOLD_BLOCK, n - start)
        if <const num*>(out + start) != ptrs[0] + start:
            memcpy(out + start, ptrs[0] + start, size * sizeof(num))
        for j in range(1, count):
            if num is float or num is double:
                if mean_divisor > 0 and j == count - 1:
                    _acc_div(out + start, ptrs[j] + start, size, <num>mean_divisor)
                    continue
            _acc(out + start, ptrs[j] + start, size, op)
        start += size


cdef int fold_raw(int code, void* out, const void** ptrs, Py_ssize_t count, Py_ssize_t n,
                  int op, double mean_divisor) noexcept nogil:
    """:func:`_fold` on untyped addresses, the item type given by its dtype code; 0, or -1
    for an unknown code."""
    if code == F32:
        _fold(<float*>out, <const float**>ptrs, count, n, op, mean_divisor)
    elif code == F64:
        _fold(<double*>out, <const double**>ptrs, count, n, op, mean_divisor)
    elif code == I8:
        _fold(<int8_t*>out, <const int8_t**>ptrs, count, n, op, mean_divisor)
    elif code == I16:
        _fold(<int16_t*>out, <const int16_t**>ptrs, count, n, op, mean_divisor)
    elif code == I32:
        _fold(<int32_t*>out, <const int32_t**>ptrs, count, n, op, mean_divisor)
    elif code == I64:
        _fold(<int64_t*>out, <const int64_t**>ptrs, count, n, op, mean_divisor)
    elif code == U8:
        _fold(<uint8_t*>out, <const uint8_t**>ptrs, count, n, op, mean_divisor)
    elif code == U16:
        _fold(<uint16_t*>out, <const uint16_t**>ptrs, count, n, op, mean_divisor)
    elif code == U32:
        _fold(<uint32_t*>out, <const uint32_t**>ptrs, count, n, op, mean_divisor)
    elif code == U64:
        _fold(<uint64_t*>out, <const uint64_t**>ptrs, count, n, op, mean_divisor)
    else:
        return -1
    return 0
