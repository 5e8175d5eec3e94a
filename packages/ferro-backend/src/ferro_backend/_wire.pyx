# cython: language_level=3
"""Byte kernels of the ferro wire format: copy, byte-swap and pack/unpack many arrays at once.

Validation (contiguity, sizes, dtypes) lives in ``wire.py``; the loops here assume valid input
and run without the GIL, so simulated ranks (threads) copy in parallel.
"""

cimport cython
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

ctypedef fused word:
    uint16_t
    uint32_t
    uint64_t


cdef extern from *:
    """
    static inline unsigned short ferro_bswap16(unsigned short x) { return __builtin_bswap16(x); }
    static inline unsigned int ferro_bswap32(unsigned int x) { return __builtin_bswap32(x); }
    static inline unsigned long long ferro_bswap64(unsigned long long x) {
        return __builtin_bswap64(x);
    }
    """
    uint16_t ferro_bswap16(uint16_t x) noexcept nogil
    uint32_t ferro_bswap32(uint32_t x) noexcept nogil
    uint64_t ferro_bswap64(uint64_t x) noexcept nogil


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _swap_words(const word* src, word* dst, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if word is uint16_t:
            dst[i] = ferro_bswap16(src[i])
        elif word is uint32_t:
            dst[i] = ferro_bswap32(src[i])
        else:
            dst[i] = ferro_bswap64(src[i])


cdef inline void _copy(const unsigned char* src, unsigned char* dst, Py_ssize_t nbytes,
                       Py_ssize_t swap) noexcept nogil:
    """Copy ``nbytes``; when ``swap`` is 2, 4 or 8, reverse the bytes of each such word."""
    if swap == 2:
        _swap_words(<const uint16_t*>src, <uint16_t*>dst, nbytes // 2)
    elif swap == 4:
        _swap_words(<const uint32_t*>src, <uint32_t*>dst, nbytes // 4)
    elif swap == 8:
        _swap_words(<const uint64_t*>src, <uint64_t*>dst, nbytes // 8)
    elif nbytes > 0:
        memcpy(dst, src, nbytes)


def copy_bytes(const unsigned char[::1] src, unsigned char[::1] dst):
    """Copy ``src`` into ``dst`` with the GIL released (the caller checked equal lengths)."""
    cdef Py_ssize_t n = src.shape[0]
    if n == 0:
        return
    with nogil:
        memcpy(&dst[0], &src[0], n)


cdef extern from "engine/_copy.h" nogil:
    void ferro_stream_copy(unsigned char* dst, const unsigned char* src, size_t n)
    const int FERRO_STREAM_STORES


#: whether :func:`stream_copy` uses non-temporal stores here (x86-64: SSE2), else memcpy
STREAM_STORES = bool(FERRO_STREAM_STORES)


def stream_copy(const unsigned char[::1] src, unsigned char[::1] dst):
    """Copy ``src`` into ``dst`` (equal lengths, else ValueError) with non-temporal stores and
    the GIL released: for blocks much larger than the cache (copying 8 MiB: about a third
    less memory traffic than memcpy, which reads each destination line first)."""
    cdef Py_ssize_t n = src.shape[0]
    if dst.shape[0] != n:
        raise ValueError(f"stream_copy: {n} bytes into a buffer of {dst.shape[0]}")
    if n == 0:
        return
    with nogil:
        ferro_stream_copy(&dst[0], &src[0], <size_t>n)


cdef struct Span:
    unsigned char* ptr
    Py_ssize_t nbytes
    Py_ssize_t swap


cdef Span* _spans(list views, list swaps) except NULL:
    """One Span per byte view (``wire.py`` checked writability where it matters); free() it."""
    cdef Py_ssize_t count = len(views), i
    cdef const unsigned char[::1] view
    cdef Span* spans = <Span*>malloc(max(count, 1) * sizeof(Span))
    if spans == NULL:
        raise MemoryError()
    for i in range(count):
        view = views[i]
        spans[i].nbytes = view.shape[0]
        spans[i].ptr = <unsigned char*>&view[0] if view.shape[0] else NULL
        spans[i].swap = swaps[i]
    return spans


cdef void _run(Span* spans, Py_ssize_t count, unsigned char* flat, bint into_flat
               ) noexcept nogil:
    """Copy every span to (``into_flat``) or from consecutive ranges of ``flat``."""
    cdef Py_ssize_t i, offset = 0
    for i in range(count):
        if spans[i].nbytes:
            if into_flat:
                _copy(spans[i].ptr, flat + offset, spans[i].nbytes, spans[i].swap)
            else:
                _copy(flat + offset, spans[i].ptr, spans[i].nbytes, spans[i].swap)
        offset += spans[i].nbytes


cdef _transfer(list views, const unsigned char[::1] flat, list swaps, bint into_flat):
    cdef Py_ssize_t count = len(views)
    cdef Span* spans
    if flat.shape[0] == 0:
        return
    spans = _spans(views, swaps)
    try:
        with nogil:
            _run(spans, count, <unsigned char*>&flat[0], into_flat)
    finally:
        free(spans)


def pack_into(list srcs, unsigned char[::1] out, list swaps):
    """Copy each byte view of ``srcs`` back to back into ``out`` in one GIL-free pass.

    ``swaps[i]`` is 0 (plain copy) or the word size whose bytes are reversed. The caller checks
    that the views fill ``out`` exactly.
    """
    _transfer(srcs, out, swaps, True)


def unpack_from(const unsigned char[::1] buf, list dsts, list swaps):
    """Copy consecutive ranges of ``buf`` into each writable byte view of ``dsts`` (the caller
    checks that they are writable and add up to ``buf``'s length)."""
    _transfer(dsts, buf, swaps, False)
