# cython: language_level=3
"""The reduction kernel (``_fold.h``) for Python: the engine's fold, callable on arrays.

ferro-collective's point-to-point algorithms fold with it (``ferro_collective.ops``), so the
engine's one-step folds, its split reductions and the algorithms over messages compute every
element the same way. Dtypes and ops are ``ferro/engine.h``'s codes (:data:`DTYPE_CODES`,
``OP_*``). The caller checks lengths and dtypes (``ferro_collective.ops``); the kernel checks
only that the byte counts agree.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdlib cimport free, malloc

cdef extern from "_fold.h" nogil:
    size_t ferro_dtype_size(int dtype)
    int ferro_op_fits(int dtype, int op)
    int ferro_fold(int dtype, void* out, const void* const* inputs, Py_ssize_t count,
                   Py_ssize_t n, int op, double mean_divisor)
    int ferro_simd_avx2()
    int FERRO_SUM, FERRO_PROD, FERRO_MAX, FERRO_MIN, FERRO_BAND, FERRO_BOR, FERRO_BXOR
    int FERRO_AVG

#: the op codes (ferro/engine.h's ferro_op)
OP_SUM, OP_PROD, OP_MAX, OP_MIN = FERRO_SUM, FERRO_PROD, FERRO_MAX, FERRO_MIN
OP_BAND, OP_BOR, OP_BXOR, OP_AVG = FERRO_BAND, FERRO_BOR, FERRO_BXOR, FERRO_AVG
#: numpy dtype name -> ferro/engine.h's ferro_dtype code
DTYPE_CODES = {"float32": 0, "float64": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5,
               "uint8": 6, "uint16": 7, "uint32": 8, "uint64": 9, "float16": 10,
               "bfloat16": 11, "bool": 12}
#: whether the float SUM/AVG loops run their AVX2 clone on this CPU (else the SSE2 baseline)
SIMD_AVX2 = bool(ferro_simd_avx2())


def op_fits(int code, int op) -> bool:
    """Whether ``op`` reduces dtype ``code`` (AVG floats only, the bitwise ops integers and
    bool, bool nothing else)."""
    return ferro_op_fits(code, op) != 0


def fold(object out, list inputs, int code, int op, double mean_divisor=0.0):
    """``out = inputs[0] op inputs[1] op ... op inputs[-1]``, in that order, in one pass, for
    dtype ``code``; ``mean_divisor`` > 0 divides in the last step (AVG, or MEAN over SUM).
    Every input and ``out`` hold the same number of bytes, a whole number of items."""
    cdef Py_ssize_t count = len(inputs), j, got = 0, n
    cdef size_t item = ferro_dtype_size(code)
    cdef Py_buffer o
    cdef Py_buffer* bufs
    cdef const void** ptrs
    cdef int rc
    if item == 0:
        raise ValueError(f"fold: unknown dtype code {code}")
    if count == 0:
        raise ValueError("fold: no inputs")
    PyObject_GetBuffer(out, &o, PyBUF_WRITABLE)
    bufs = <Py_buffer*>malloc(count * sizeof(Py_buffer))
    ptrs = <const void**>malloc(count * sizeof(void*))
    try:
        if bufs == NULL or ptrs == NULL:
            raise MemoryError()
        if o.len % item:
            raise ValueError(f"fold: {o.len} bytes of output are not whole {item}-byte items")
        for j in range(count):
            PyObject_GetBuffer(inputs[j], &bufs[j], PyBUF_SIMPLE)
            got += 1
            if bufs[j].len != o.len:
                raise ValueError(f"fold: input {j} has {bufs[j].len} bytes, the output "
                                 f"{o.len}")
            ptrs[j] = bufs[j].buf
        n = o.len // item
        with nogil:
            rc = ferro_fold(code, o.buf, ptrs, count, n, op, mean_divisor)
        if rc != 0:
            raise ValueError(f"fold: op {op} does not reduce dtype code {code}")
    finally:
        for j in range(got):
            PyBuffer_Release(&bufs[j])
        PyBuffer_Release(&o)
        free(bufs)
        free(ptrs)


def accumulate(object acc, object x, int code, int op):
    """``acc = acc op x`` element-wise (a two-input :func:`fold` into ``acc``)."""
    fold(acc, [acc, x], code, op)


def accumulate_mean(object acc, object x, int code, double divisor):
    """MEAN's last pass: ``acc = (acc + x) / divisor`` in one sweep."""
    fold(acc, [acc, x], code, FERRO_SUM, divisor)
