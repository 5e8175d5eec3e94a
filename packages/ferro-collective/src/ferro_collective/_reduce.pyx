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
from libc.string cimport memmove

include "_kernels.pxi"

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__x86_64__) || defined(_M_X64)
    #include <emmintrin.h>
    #define FERRO_STREAM_STORES 1
    #else
    #define FERRO_STREAM_STORES 0
    #endif
    /* d = s (n bytes, not overlapping) with stores that bypass the caches where the CPU has
       them (SSE2, every x86-64): a cached store first reads the line it writes, a streaming
       store does not, which is a third less memory traffic for a copy larger than the caches
       whose destination is not read again at once. Elsewhere: memcpy. */
    static void ferro_stream_copy(char *d, const char *s, size_t n) {
    #if FERRO_STREAM_STORES
        size_t head = (size_t)(-(uintptr_t)d) & 15, i = 0;
        if (head > n) head = n;
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
        _mm_sfence();
        memcpy(d + i, s + i, n - i);
    #else
        memcpy(d, s, n);
    #endif
    }
    """
    int FERRO_STREAM_STORES
    void ferro_stream_copy(char *d, const char *s, size_t n) noexcept nogil

OP_SUM, OP_PROD, OP_MAX, OP_MIN = SUM, PROD, MAX, MIN
OP_BAND, OP_BOR, OP_BXOR = BAND, BOR, BXOR

#: copies of at least this many bytes use streaming stores (:func:`copy`): measured here, one
#: rank copying while another does, 8 MiB 12.7 -> 15.6 GB/s and 32 MiB 5.6 -> 11.7 GB/s, but
#: 1 MiB 21.9 -> 19.2 GB/s (a destination that fits the caches is better written through them)
STREAM_COPY_BYTES = 4 << 20
#: whether :func:`copy` has streaming stores on this CPU (else it is memcpy at every size)
STREAMING = bool(FERRO_STREAM_STORES)

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


def copy(unsigned char[::1] dst, const unsigned char[::1] src,
         Py_ssize_t stream_min=STREAM_COPY_BYTES):
    """``dst[:] = src`` (bytes of equal length): streaming stores from ``stream_min`` bytes on
    (:data:`STREAM_COPY_BYTES` by default), else, or when the two overlap, memmove."""
    cdef Py_ssize_t n = src.shape[0]
    cdef char* d
    cdef const char* s
    if dst.shape[0] != n:
        raise ValueError(f"copy: dst has {dst.shape[0]} bytes, src {n}")
    if n == 0:
        return
    d = <char*>&dst[0]
    s = <const char*>&src[0]
    with nogil:
        if n < stream_min or (d < s + n and s < d + n):
            if d != s:
                memmove(d, s, n)
        else:
            ferro_stream_copy(d, s, n)
