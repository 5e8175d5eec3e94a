# cython: language_level=3
"""Reduction kernels: ``acc = op(acc, x)`` element-wise, with the MEAN divide fused, and the
N-way rank-order fold every engine reduction runs.

Ops: SUM, PROD, MAX, MIN on every kernel dtype, and the bitwise BAND, BOR, BXOR on the integer
dtypes only (``ops.work_dtype`` refuses floats before a kernel runs; bool arrays are reduced as
uint8 views, whose 0/1 values the bitwise ops keep).

Inputs are validated by ``ops.py`` (same length, same dtype, contiguous, writable accumulator);
loops run without the GIL so simulated ranks (threads) reduce in parallel. The order is fixed:
each call folds exactly one buffer into the accumulator, so a schedule of calls fixes every
element's summation order (IEEE addition and multiplication are commutative, not associative).

:data:`FOLD` hands :func:`fold_raw` (the fold on untyped addresses) to ferro-backend's engine,
which runs it on the slots of a one-call reduction: a capsule whose name is the C signature
(``ferro_backend.engine.FOLD_SIGNATURE``), as scipy's LowLevelCallable passes callbacks.
"""

from cpython.pycapsule cimport PyCapsule_New
from libc.stdlib cimport free, malloc

cimport cython
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy


cdef extern from "_simd.h" nogil:
    void ferro_add3_f32(float* out, const float* a, const float* b, Py_ssize_t n)
    void ferro_add3_f64(double* out, const double* a, const double* b, Py_ssize_t n)
    void ferro_add3_div_f32(float* out, const float* a, const float* b, float d, Py_ssize_t n)
    void ferro_add3_div_f64(double* out, const double* a, const double* b, double d,
                            Py_ssize_t n)
    int ferro_simd_avx2()

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

# the op codes (exported as OP_*, so that ops.py reads them from one definition)
cdef enum:
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    BAND = 4
    BOR = 5
    BXOR = 6

# the dtype codes of fold_raw (exported as DTYPE_CODES)
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
        if num is float:
            ferro_add3_f32(acc, acc, x, n)
        elif num is double:
            ferro_add3_f64(acc, acc, x, n)
        else:
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
    if real is float:
        ferro_add3_div_f32(acc, acc, x, d, n)
    else:
        ferro_add3_div_f64(acc, acc, x, d, n)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _combine(num* out, const num* a, const num* b, Py_ssize_t n, int op,
                          double mean_divisor) noexcept nogil:
    """``out = a op b`` in one pass (three streams instead of a copy and an in-place pass),
    each element exactly as ``_acc`` on a copy of ``a`` gives it; ``out`` may be ``a`` or ``b``. With
    ``mean_divisor`` > 0 (floats, SUM) ``out = (a + b) / mean_divisor``."""
    cdef Py_ssize_t i
    cdef num x
    if num is float:
        if mean_divisor > 0:
            ferro_add3_div_f32(out, a, b, <float>mean_divisor, n)
        elif op == SUM:
            ferro_add3_f32(out, a, b, n)
        if mean_divisor > 0 or op == SUM:
            return
    elif num is double:
        if mean_divisor > 0:
            ferro_add3_div_f64(out, a, b, mean_divisor, n)
        elif op == SUM:
            ferro_add3_f64(out, a, b, n)
        if mean_divisor > 0 or op == SUM:
            return
    if op == SUM:
        for i in range(n):
            out[i] = a[i] + b[i]
    elif op == PROD:
        for i in range(n):
            out[i] = a[i] * b[i]
    elif op == MAX:  # NaN propagates as in _acc
        for i in range(n):
            x = a[i]
            if not (x >= b[i]):
                if num is float or num is double:
                    if x != x:
                        out[i] = x
                        continue
                x = b[i]
            out[i] = x
    elif op == MIN:
        for i in range(n):
            x = a[i]
            if not (x <= b[i]):
                if num is float or num is double:
                    if x != x:
                        out[i] = x
                        continue
                x = b[i]
            out[i] = x
    elif num is not float and num is not double:
        if op == BAND:
            for i in range(n):
                out[i] = a[i] & b[i]
        elif op == BOR:
            for i in range(n):
                out[i] = a[i] | b[i]
        elif op == BXOR:
            for i in range(n):
                out[i] = a[i] ^ b[i]


#: elements per block of a fold: the block of the output stays in cache while every input is
#: folded into it
cdef Py_ssize_t FOLD_BLOCK = 4096


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _fold(num* out, const num** ptrs, Py_ssize_t count, Py_ssize_t n, int op,
                       double mean_divisor) noexcept nogil:
    """``out = ptrs[0] op ptrs[1] op ... op ptrs[count - 1]`` (``n`` items each), in that
    order, block by block; with ``mean_divisor`` > 0 the last step also divides (MEAN)."""
    cdef Py_ssize_t start = 0, size, j
    while start < n:
        size = min(FOLD_BLOCK, n - start)
        if count >= 2:  # the first two inputs in one pass
            _combine(out + start, ptrs[0] + start, ptrs[1] + start, size, op,
                     mean_divisor if count == 2 else 0.0)
        elif <const num*>(out + start) != ptrs[0] + start:
            memcpy(out + start, ptrs[0] + start, size * sizeof(num))
        for j in range(2, count):
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


OP_SUM, OP_PROD, OP_MAX, OP_MIN = SUM, PROD, MAX, MIN
#: whether the float SUM/MEAN loops run their AVX2 clone on this CPU (else the SSE2 baseline)
SIMD_AVX2 = bool(ferro_simd_avx2())
OP_BAND, OP_BOR, OP_BXOR = BAND, BOR, BXOR

#: numpy dtype name -> the dtype code of :func:`fold_raw` (the engine's one-call folds)
DTYPE_CODES = {"float32": F32, "float64": F64, "int8": I8, "int16": I16, "int32": I32,
               "int64": I64, "uint8": U8, "uint16": U16, "uint32": U32, "uint64": U64}


def accumulate(num[::1] acc, const num[::1] x, int op):
    """``acc[i] = op(acc[i], x[i])`` with op one of OP_SUM, OP_PROD, OP_MAX, OP_MIN, and for
    integer dtypes OP_BAND, OP_BOR, OP_BXOR.

    ``ops.accumulate`` checks that ``x`` has ``acc``'s length; the kernel trusts it.
    """
    cdef Py_ssize_t n = acc.shape[0]
    if n == 0:
        return
    with nogil:
        _acc(&acc[0], &x[0], n, op)


def accumulate_mean(real[::1] acc, const real[::1] x, double divisor):
    """Last pass of a MEAN: ``acc[i] = (acc[i] + x[i]) / divisor`` in one sweep (lengths
    checked by ``ops.accumulate``)."""
    cdef Py_ssize_t n = acc.shape[0]
    if n == 0:
        return
    with nogil:
        _acc_div(&acc[0], &x[0], n, <real>divisor)


def fold(num[::1] out, list inputs, int op, double mean_divisor):
    """``out = inputs[0] op inputs[1] op ... op inputs[-1]``, in that order, in one pass.

    With ``mean_divisor`` > 0 the last step also divides (MEAN). Each element is combined in
    list order, exactly as a sequence of :func:`accumulate` calls would (so the bits equal the
    star algorithm's rank-order fold). ``ops.fold`` checks that every input is a C-contiguous
    array of ``out``'s dtype and length; the kernel trusts it.
    """
    cdef Py_ssize_t count = len(inputs), n = out.shape[0], j
    cdef const num[::1] view
    cdef const num** ptrs
    if n == 0 or count == 0:
        return
    ptrs = <const num**>malloc(count * sizeof(const num*))
    if ptrs == NULL:
        raise MemoryError()
    try:
        for j in range(count):
            view = inputs[j]
            ptrs[j] = &view[0]
        with nogil:
            _fold(&out[0], ptrs, count, n, op, mean_divisor)
    finally:
        free(ptrs)


cdef int _fold_entry(int code, void* out, const void** inputs, Py_ssize_t count, Py_ssize_t n,
                     int op, double mean_divisor) noexcept nogil:
    return fold_raw(code, out, inputs, count, n, op, mean_divisor)


#: the capsule name of :data:`FOLD`: the signature the engine accepts (a test holds the two equal)
FOLD_SIGNATURE = ("int (int code, void *out, const void **inputs, Py_ssize_t count, "
                  "Py_ssize_t n, int op, double mean_divisor)")
cdef bytes _FOLD_NAME = FOLD_SIGNATURE.encode()
#: the rank-order fold on untyped addresses, for ferro-backend's engine (``SlotEngine.set_fold``)
FOLD = PyCapsule_New(<void*>_fold_entry, _FOLD_NAME, NULL)
