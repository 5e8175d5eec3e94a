# cython: language_level=3
"""Reduction kernels: ``acc = op(acc, x)`` element-wise, with the MEAN divide fused.

Ops: SUM, PROD, MAX, MIN on every kernel dtype, and the bitwise BAND, BOR, BXOR on the integer
dtypes only (``ops.work_dtype`` refuses floats before a kernel runs; bool arrays are reduced as
uint8 views, whose 0/1 values the bitwise ops keep).

Inputs are validated by ``ops.py`` (same length, same dtype, contiguous, writable accumulator);
loops run without the GIL so simulated ranks (threads) reduce in parallel. The order is fixed:
each call folds exactly one buffer into the accumulator, so a schedule of calls fixes every
element's summation order (IEEE addition and multiplication are commutative, not associative).
"""

from libc.stdlib cimport free, malloc

include "_kernels.pxi"

OP_SUM, OP_PROD, OP_MAX, OP_MIN = SUM, PROD, MAX, MIN
OP_BAND, OP_BOR, OP_BXOR = BAND, BOR, BXOR

#: numpy dtype name -> the dtype code of the engine's address-level folds (``_shmcoll``)
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
