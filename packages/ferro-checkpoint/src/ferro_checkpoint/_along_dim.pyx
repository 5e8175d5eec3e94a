# cython: language_level=3
"""Copy a slab ``[start, stop)`` along one dimension between C-contiguous arrays, any dtype.

An array of shape ``(outer, length, inner)`` (``outer`` = product of the dims before ``dim``,
``inner`` = product after, times the item size) is ``outer`` rows of ``length * inner`` bytes, so
a slab along ``dim`` is ``outer`` contiguous runs. ``concat_along_dim`` and ``slice_along_dim``
(``along_dim.py``) are both made of this one kernel; the element type is the fused ``word``
picked from the run's alignment (8, 4, 2 or 1 bytes), and the loops run without the GIL.
Validation lives in ``along_dim.py`` only: the kernel assumes valid input.
"""

cimport cython
from libc.stdint cimport uint16_t, uint32_t, uint64_t, uint8_t
from libc.string cimport memcpy

ctypedef fused word:
    uint8_t
    uint16_t
    uint32_t
    uint64_t


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline void _slab(const word* src, word* dst, Py_ssize_t outer, Py_ssize_t src_row,
                       Py_ssize_t dst_row, Py_ssize_t src_off, Py_ssize_t dst_off,
                       Py_ssize_t run) noexcept nogil:
    """All sizes in words: copy ``run`` words from each source row at ``src_off`` into each
    destination row at ``dst_off``."""
    cdef Py_ssize_t o
    for o in range(outer):
        memcpy(dst + o * dst_row + dst_off, src + o * src_row + src_off, run * sizeof(word))


cdef void _dispatch(const unsigned char* src, unsigned char* dst, Py_ssize_t outer,
                    Py_ssize_t src_row, Py_ssize_t dst_row, Py_ssize_t src_off,
                    Py_ssize_t dst_off, Py_ssize_t run) noexcept nogil:
    cdef Py_ssize_t g = src_row | dst_row | src_off | dst_off | run
    if g % 8 == 0:
        _slab[uint64_t](<const uint64_t*>src, <uint64_t*>dst, outer, src_row // 8, dst_row // 8,
                        src_off // 8, dst_off // 8, run // 8)
    elif g % 4 == 0:
        _slab[uint32_t](<const uint32_t*>src, <uint32_t*>dst, outer, src_row // 4, dst_row // 4,
                        src_off // 4, dst_off // 4, run // 4)
    elif g % 2 == 0:
        _slab[uint16_t](<const uint16_t*>src, <uint16_t*>dst, outer, src_row // 2, dst_row // 2,
                        src_off // 2, dst_off // 2, run // 2)
    else:
        _slab[uint8_t](src, dst, outer, src_row, dst_row, src_off, dst_off, run)


def copy_slab(const unsigned char[::1] src, unsigned char[::1] dst, Py_ssize_t outer,
              Py_ssize_t src_len, Py_ssize_t dst_len, Py_ssize_t inner_bytes,
              Py_ssize_t src_start, Py_ssize_t dst_start, Py_ssize_t count):
    """``dst[:, dst_start:dst_start+count, :] = src[:, src_start:src_start+count, :]`` on the
    byte views of ``(outer, src_len, inner)`` and ``(outer, dst_len, inner)`` arrays.

    Assumes valid input (``along_dim.py`` validates): the views hold exactly those shapes and
    the slab lies inside both arrays."""
    cdef Py_ssize_t src_row = src_len * inner_bytes, dst_row = dst_len * inner_bytes
    cdef Py_ssize_t run = count * inner_bytes
    if run == 0 or outer == 0:
        return
    with nogil:
        _dispatch(&src[0], &dst[0], outer, src_row, dst_row, src_start * inner_bytes,
                  dst_start * inner_bytes, run)
