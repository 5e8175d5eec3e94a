# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The wire formats' hot loops (:mod:`ferro_collective.wire`), one pass each, without the GIL:
float32 to bfloat16 (round to nearest even) and back folded into a float32 accumulator, and
the int8 and int4 blocks (a float32 scale per block of ``BLOCK`` values) both ways. Their numpy
references are the tests' (``tests/test_wire.py``). Every index is below the lengths checked
on entry (``_check``), which is what lets bounds checking off."""

from libc.math cimport fabsf, isnan, nanf
from libc.stdint cimport int8_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memcpy

cdef extern from "_half.h" nogil:
    float ferro_float_of_half(uint16_t h)
    void ferro_half_encode(const float* x, uint16_t* out, size_t n, int plain)
    size_t ferro_half_decode(const uint16_t* q, float* acc, size_t n, int op, int plain)
    int ferro_half_f16c()

#: values per int8 block (one float32 scale each)
BLOCK = 256
cdef Py_ssize_t _BLOCK = 256
cdef float _FLT_MAX = 3.4028234663852886e38
cdef float _ROUNDER = 12582912.0  # 1.5 * 2**23

#: fold codes of decode_into (the accumulator's update)
COPY, SUM, MAX, MIN, PRODUCT = range(5)
#: whether the half-precision codec runs on the CPU's F16C instructions here (else plain C,
#: which gives the same bits)
HAVE_F16C = bool(ferro_half_f16c())


cdef inline int _check(Py_ssize_t want, Py_ssize_t have, str what) except -1:
    if have < want:
        raise ValueError(f"{what}: {have} values, need {want}")
    return 0


cdef inline float _fold(int op, float acc, float v) noexcept nogil:
    if op == 1:
        return acc + v
    if op == 2:
        return v if (v > acc or isnan(v)) and not isnan(acc) else acc
    if op == 3:
        return v if (v < acc or isnan(v)) and not isnan(acc) else acc
    if op == 4:
        return acc * v
    return v


def encode_bf16(const float[::1] x, uint16_t[::1] out):
    """``out[i]`` = ``x[i]`` as bfloat16 (round to nearest even; NaN stays a quiet NaN)."""
    cdef Py_ssize_t i, n = x.shape[0]
    cdef uint32_t u
    _check(n, out.shape[0], "encode_bf16: out")
    with nogil:
        for i in range(n):
            memcpy(&u, &x[i], 4)
            if isnan(x[i]):
                out[i] = <uint16_t>((u >> 16) | 0x40)
            else:
                out[i] = <uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


def decode_bf16_into(const uint16_t[::1] q, float[::1] acc, int op):
    """``acc[i]`` = fold(``acc[i]``, ``q[i]`` as float32) (``op``: COPY, SUM, MAX, MIN,
    PRODUCT; MAX and MIN as numpy's maximum/minimum: a NaN wins)."""
    cdef Py_ssize_t i, n = acc.shape[0]
    cdef uint32_t u
    cdef float v
    _check(n, q.shape[0], "decode_bf16_into: q")
    with nogil:
        if op == 0:  # (the common folds as loops of their own: they vectorize)
            for i in range(n):
                u = (<uint32_t>q[i]) << 16
                memcpy(&acc[i], &u, 4)
        elif op == 1:
            for i in range(n):
                u = (<uint32_t>q[i]) << 16
                memcpy(&v, &u, 4)
                acc[i] = acc[i] + v
        else:
            for i in range(n):
                u = (<uint32_t>q[i]) << 16
                memcpy(&v, &u, 4)
                acc[i] = _fold(op, acc[i], v)


cdef inline bint _block_top(const float* x, Py_ssize_t n, float* top) noexcept nogil:
    """The largest magnitude of ``x[:n]`` into ``top``; True where a value is NaN or inf
    (branch-free: it vectorizes)."""
    cdef Py_ssize_t i
    cdef float a, t = 0
    cdef int bad = 0
    for i in range(n):
        a = fabsf(x[i])
        bad |= <int>(not (a <= _FLT_MAX))  # NaN or inf
        t = a if a > t else t
    top[0] = t
    return bad != 0


cdef inline int _level(float x, float s, float most) noexcept nogil:
    """``x / s`` rounded to the nearest integer, ties to even (as rint), within +-``most``:
    |x / s| <= most here, and adding and taking away 1.5 * 2**23 rounds it, in plain SSE2
    arithmetic."""
    cdef float v = (x / s + _ROUNDER) - _ROUNDER
    return <int>(most if v > most else (-most if v < -most else v))


def encode_fp16(const float[::1] x, uint16_t[::1] out, bint plain=False):
    """``out[i]`` = ``x[i]`` as an IEEE half's bits (round to nearest even; too large: an
    infinity; a NaN: a quiet NaN, its payload's top bits kept). ``plain``: without F16C even
    where the CPU has it (the same bits; for the tests)."""
    cdef Py_ssize_t n = x.shape[0]
    _check(n, out.shape[0], "encode_fp16: out")
    if n:
        with nogil:
            ferro_half_encode(&x[0], &out[0], <size_t>n, plain)


def decode_fp16_into(const uint16_t[::1] q, float[::1] acc, int op, bint plain=False):
    """``acc[i]`` = fold(``acc[i]``, half ``q[i]`` as float32) (``op`` as for
    :func:`decode_bf16_into`)."""
    cdef Py_ssize_t i, n = acc.shape[0]
    _check(n, q.shape[0], "decode_fp16_into: q")
    if n == 0:
        return
    with nogil:
        if ferro_half_decode(&q[0], &acc[0], <size_t>n, op, plain) == 0:  # (MAX, MIN, PRODUCT)
            for i in range(n):
                acc[i] = _fold(op, acc[i], ferro_float_of_half(q[i]))


def encode_int8(const float[::1] x, float[::1] scales, int8_t[::1] q):
    """Blocks of ``BLOCK`` values of ``x`` (the last one padded with zeros): ``scales[b]`` =
    max |x| / 127 of block ``b`` (NaN where it holds a NaN or an inf), ``q`` = rint(x /
    scale) (0 in a zero or non-finite block)."""
    cdef Py_ssize_t n = x.shape[0], blocks = (n + _BLOCK - 1) // _BLOCK, b, i, lo, hi
    cdef float top, s
    _check(blocks, scales.shape[0], "encode_int8: scales")
    _check(blocks * _BLOCK, q.shape[0], "encode_int8: q")
    with nogil:
        for b in range(blocks):
            lo = b * _BLOCK
            hi = lo + _BLOCK if lo + _BLOCK < n else n
            for i in range(hi, lo + _BLOCK):
                q[i] = 0
            if _block_top(&x[lo], hi - lo, &top):
                scales[b] = nanf("")
                s = 0
            else:
                s = top / <float>127
                scales[b] = s
            if s == 0:  # (a zero or a non-finite block)
                for i in range(lo, hi):
                    q[i] = 0
                continue
            for i in range(lo, hi):
                q[i] = <int8_t>_level(x[i], s, 127)


def decode_int8_into(const float[::1] scales, const int8_t[::1] q, float[::1] acc, int op):
    """``acc[i]`` = fold(``acc[i]``, ``q[i]`` times its block's scale) (``op`` as for
    :func:`decode_bf16_into`)."""
    cdef Py_ssize_t n = acc.shape[0], blocks = (n + _BLOCK - 1) // _BLOCK, b, i, lo, hi
    cdef float s
    _check(blocks, scales.shape[0], "decode_int8_into: scales")
    _check(n, q.shape[0], "decode_int8_into: q")
    with nogil:
        for b in range(blocks):
            lo = b * _BLOCK
            hi = lo + _BLOCK if lo + _BLOCK < n else n
            s = scales[b]
            if op == 0:  # (the common folds as loops of their own: they vectorize)
                for i in range(lo, hi):
                    acc[i] = <float>q[i] * s
            elif op == 1:
                for i in range(lo, hi):
                    acc[i] = acc[i] + <float>q[i] * s
            else:
                for i in range(lo, hi):
                    acc[i] = _fold(op, acc[i], <float>q[i] * s)


def encode_int4(const float[::1] x, float[::1] scales, uint8_t[::1] q):
    """As :func:`encode_int8` with 4-bit values: ``scales[b]`` = max |x| / 7, each value
    rint(x / scale) in -7..7 stored as its two's complement nibble, two a byte (the even index
    in the low nibble): ``BLOCK // 2`` bytes a block."""
    cdef Py_ssize_t n = x.shape[0], blocks = (n + _BLOCK - 1) // _BLOCK, b, i, lo, hi
    cdef float top, s
    _check(blocks, scales.shape[0], "encode_int4: scales")
    _check(blocks * (_BLOCK // 2), q.shape[0], "encode_int4: q")
    with nogil:
        for b in range(blocks):
            lo = b * _BLOCK  # (even: a block starts on a byte)
            hi = lo + _BLOCK if lo + _BLOCK < n else n
            for i in range((hi + 1) // 2, (lo + _BLOCK) // 2):
                q[i] = 0
            if _block_top(&x[lo], hi - lo, &top):
                scales[b] = nanf("")
                s = 0
            else:
                s = top / <float>7
                scales[b] = s
            if s == 0:
                for i in range(lo // 2, (hi + 1) // 2):
                    q[i] = 0
                continue
            for i in range(lo, hi - 1, 2):  # two values a byte
                q[i >> 1] = <uint8_t>((_level(x[i], s, 7) & 0xF)
                                      | ((_level(x[i + 1], s, 7) & 0xF) << 4))
            if (hi - lo) & 1:  # an odd last value: the low nibble alone
                q[(hi - 1) >> 1] = <uint8_t>(_level(x[hi - 1], s, 7) & 0xF)


cdef inline float _nibble(uint8_t byte, int high) noexcept nogil:
    """The two's complement nibble of ``byte`` (the high one if ``high``) as a float."""
    cdef int nib = (byte >> 4) if high else (byte & 0xF)
    return <float>((nib ^ 8) - 8)


def decode_int4_into(const float[::1] scales, const uint8_t[::1] q, float[::1] acc, int op):
    """``acc[i]`` = fold(``acc[i]``, value ``i`` of :func:`encode_int4`'s ``q`` times its
    block's scale) (``op`` as for :func:`decode_bf16_into`)."""
    cdef Py_ssize_t n = acc.shape[0], blocks = (n + _BLOCK - 1) // _BLOCK, b, i, lo, hi
    cdef float s
    _check(blocks, scales.shape[0], "decode_int4_into: scales")
    _check((n + 1) // 2, q.shape[0], "decode_int4_into: q")
    with nogil:
        for b in range(blocks):
            lo = b * _BLOCK
            hi = lo + _BLOCK if lo + _BLOCK < n else n
            s = scales[b]
            if op == 0:  # (the common folds as loops of their own, a byte at a time)
                for i in range(lo, hi - 1, 2):
                    acc[i] = _nibble(q[i >> 1], 0) * s
                    acc[i + 1] = _nibble(q[i >> 1], 1) * s
            elif op == 1:
                for i in range(lo, hi - 1, 2):
                    acc[i] = acc[i] + _nibble(q[i >> 1], 0) * s
                    acc[i + 1] = acc[i + 1] + _nibble(q[i >> 1], 1) * s
            else:
                for i in range(lo, hi - 1, 2):
                    acc[i] = _fold(op, acc[i], _nibble(q[i >> 1], 0) * s)
                    acc[i + 1] = _fold(op, acc[i + 1], _nibble(q[i >> 1], 1) * s)
            if (hi - lo) & 1:
                i = hi - 1
                acc[i] = _fold(op, acc[i], _nibble(q[i >> 1], 0) * s)
