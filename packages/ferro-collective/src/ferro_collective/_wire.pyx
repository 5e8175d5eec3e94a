# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The wire formats' hot loops (:mod:`ferro_collective.wire`), one pass each, without the GIL:
float32 to bfloat16 (round to nearest even) and back folded into a float32 accumulator, and
the int8 and int4 blocks (a float32 scale per block of ``BLOCK`` values) both ways. Their numpy
references are the tests' (``tests/test_wire.py``). Every index is below the lengths checked
on entry (``_check``), which is what lets bounds checking off."""

from libc.math cimport fabsf, isnan, nanf
from libc.stdint cimport int8_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memcpy

#: values per int8 block (one float32 scale each)
BLOCK = 256
cdef Py_ssize_t _BLOCK = 256
cdef float _FLT_MAX = 3.4028234663852886e38
cdef float _ROUNDER = 12582912.0  # 1.5 * 2**23

#: fold codes of decode_into (the accumulator's update)
COPY, SUM, MAX, MIN, PRODUCT = range(5)


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


def encode_int8(const float[::1] x, float[::1] scales, int8_t[::1] q):
    """Blocks of ``BLOCK`` values of ``x`` (the last one padded with zeros): ``scales[b]`` =
    max |x| / 127 of block ``b`` (NaN where it holds a NaN or an inf), ``q`` = rint(x /
    scale) (0 in a zero or non-finite block)."""
    cdef Py_ssize_t n = x.shape[0], blocks = (n + _BLOCK - 1) // _BLOCK, b, i, lo, hi
    cdef float top, a, s, v
    cdef int bad
    _check(blocks, scales.shape[0], "encode_int8: scales")
    _check(blocks * _BLOCK, q.shape[0], "encode_int8: q")
    with nogil:
        for b in range(blocks):
            lo = b * _BLOCK
            hi = lo + _BLOCK if lo + _BLOCK < n else n
            top = 0
            bad = 0
            for i in range(lo, hi):  # (branch-free: it vectorizes)
                a = fabsf(x[i])
                bad |= <int>(not (a <= _FLT_MAX))  # NaN or inf
                top = a if a > top else top
            for i in range(hi, lo + _BLOCK):
                q[i] = 0
            if bad:
                scales[b] = nanf("")
                for i in range(lo, hi):
                    q[i] = 0
                continue
            s = top / <float>127
            scales[b] = s
            if s == 0:
                for i in range(lo, hi):
                    q[i] = 0
                continue
            for i in range(lo, hi):
                # |x / s| <= 127 here: adding and taking away 1.5 * 2**23 rounds it to the
                # nearest integer, ties to even (as rint), in plain SSE2 arithmetic
                v = (x[i] / s + _ROUNDER) - _ROUNDER
                q[i] = <int8_t>(127 if v > 127 else (-127 if v < -127 else v))


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
    cdef float top, a, s, v
    cdef int bad, k
    cdef uint8_t nib
    _check(blocks, scales.shape[0], "encode_int4: scales")
    _check(blocks * (_BLOCK // 2), q.shape[0], "encode_int4: q")
    with nogil:
        for b in range(blocks):
            lo = b * _BLOCK
            hi = lo + _BLOCK if lo + _BLOCK < n else n
            top = 0
            bad = 0
            for i in range(lo, hi):
                a = fabsf(x[i])
                bad |= <int>(not (a <= _FLT_MAX))
                top = a if a > top else top
            for i in range(lo // 2, (lo + _BLOCK) // 2):
                q[i] = 0
            if bad:
                scales[b] = nanf("")
                continue
            s = top / <float>7
            scales[b] = s
            if s == 0:
                continue
            for i in range(lo, hi):
                v = (x[i] / s + _ROUNDER) - _ROUNDER
                k = <int>(7 if v > 7 else (-7 if v < -7 else v))
                nib = <uint8_t>(k & 0xF)
                if i & 1:
                    q[i >> 1] = q[i >> 1] | <uint8_t>(nib << 4)
                else:
                    q[i >> 1] = q[i >> 1] | nib


def decode_int4_into(const float[::1] scales, const uint8_t[::1] q, float[::1] acc, int op):
    """``acc[i]`` = fold(``acc[i]``, value ``i`` of :func:`encode_int4`'s ``q`` times its
    block's scale) (``op`` as for :func:`decode_bf16_into`)."""
    cdef Py_ssize_t n = acc.shape[0], blocks = (n + _BLOCK - 1) // _BLOCK, b, i, lo, hi
    cdef float s, v
    cdef int nib
    _check(blocks, scales.shape[0], "decode_int4_into: scales")
    _check((n + 1) // 2, q.shape[0], "decode_int4_into: q")
    with nogil:
        for b in range(blocks):
            lo = b * _BLOCK
            hi = lo + _BLOCK if lo + _BLOCK < n else n
            s = scales[b]
            for i in range(lo, hi):
                nib = (q[i >> 1] >> (4 * (i & 1))) & 0xF
                v = <float>(nib - 16 if nib > 7 else nib) * s
                acc[i] = v if op == 0 else (acc[i] + v if op == 1 else _fold(op, acc[i], v))
