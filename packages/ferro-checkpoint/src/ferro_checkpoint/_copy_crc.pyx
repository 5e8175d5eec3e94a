# cython: language_level=3
"""Move tensor bytes and checksum them in the same pass (CRC-32C, ``_crc32c.h``), without the GIL.

- :func:`copy_window`: a load. The bytes of a tensor in a shard file are cut into chunks of
  ``chunk`` bytes (the last one shorter), each with its own CRC-32C; a window of whole chunks is
  read once: each byte is folded into its chunk's checksum and, if a new rank needs it, copied to
  the destination in the same pass. The bytes a rank needs are ``outer`` runs of ``run`` bytes,
  one every ``src_row`` bytes from ``src_off`` (one run when the shard is read whole).
- :func:`write_chunks`: a save. Each chunk is checksummed, then written while it is in the cache.
- :func:`crc32c` and :func:`crc32c_chunks`: checksums alone (zero-copy loads verify with them).

Validation lives in ``copy_plan.py`` (and ``safetensors_io.py`` for writes): the kernels assume
valid input. Every checksum is the standard CRC-32C of the bytes (RFC 3720's), whatever the CPU.
"""

cimport cython
from libc.errno cimport EINTR, errno
from libc.stdint cimport uint8_t, uint32_t

cdef extern from "unistd.h" nogil:
    Py_ssize_t c_write "write" (int fd, const void* buf, size_t n)

cdef extern from "_crc32c.h" nogil:
    void ferro_crc32c_init()
    const char* ferro_crc32c_impl()
    int ferro_crc32c_set_hw(int on)
    uint32_t ferro_crc32c_update(uint32_t s, const uint8_t* src, uint8_t* dst, size_t n,
                                 int stream)
    void ferro_copy(uint8_t* dst, const uint8_t* src, size_t n, int stream)

ferro_crc32c_init()


def implementation() -> str:
    """What computes the checksums here: ``"sse4.2"``, ``"armv8-crc"`` or ``"software"``."""
    return ferro_crc32c_impl().decode()


def use_hardware(bint on) -> bool:
    """Use the CPU's CRC instruction (where it has one) or the tables; returns whether the
    instruction is in use now. For tests: both give the same checksums."""
    return ferro_crc32c_set_hw(on) != 0


def crc32c(const uint8_t[::1] data, uint32_t crc=0) -> int:
    """The CRC-32C of ``data``, continuing from ``crc`` (the checksum of the bytes before)."""
    cdef uint32_t s = ~crc
    cdef size_t n = data.shape[0]
    if n:
        with nogil:
            s = ferro_crc32c_update(s, &data[0], NULL, n, 0)
    return ~s


def crc32c_chunks(const uint8_t[::1] src, uint32_t[::1] crcs, Py_ssize_t chunk) -> None:
    """``crcs[i]`` = CRC-32C of ``src[i*chunk:(i+1)*chunk]``, for the ``len(crcs)`` chunks that
    cover ``src`` exactly (the last may be short; an empty ``src`` has one empty chunk)."""
    cdef Py_ssize_t n = src.shape[0], i, lo, hi
    cdef const uint8_t* p
    if crcs.shape[0] == 0:
        return
    if n == 0:
        crcs[0] = 0
        return
    p = &src[0]
    with nogil:
        for i in range(crcs.shape[0]):
            lo = i * chunk
            hi = lo + chunk if lo + chunk < n else n
            crcs[i] = ~ferro_crc32c_update(0xFFFFFFFF, p + lo, NULL, <size_t>(hi - lo), 0)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _window(const uint8_t* src, uint8_t* dst, Py_ssize_t lo, Py_ssize_t hi,
                  Py_ssize_t outer, Py_ssize_t src_row, Py_ssize_t dst_row, Py_ssize_t src_off,
                  Py_ssize_t dst_off, Py_ssize_t run, uint32_t* crcs, Py_ssize_t nchunks,
                  Py_ssize_t chunk, int stream) noexcept nogil:
    """The loop of :func:`copy_window` (``nchunks`` 0: copy only). Runs are disjoint and in
    order; ``o`` is the first run not wholly before the position ``p``."""
    cdef Py_ssize_t o = 0, i, p, q, cs, ce, rs, re
    cdef uint32_t s
    if run == 0 or outer == 0:
        o = outer
    elif lo > src_off + run and src_row > 0:
        o = (lo - src_off - run) // src_row + 1
    if nchunks == 0:
        while o < outer:
            rs = o * src_row + src_off
            p = rs if rs > lo else lo
            q = rs + run if rs + run < hi else hi
            if p >= hi:
                break
            if p < q:
                ferro_copy(dst + o * dst_row + dst_off + (p - rs), src + p, <size_t>(q - p),
                           stream)
            o += 1
        return
    for i in range(nchunks):
        cs = lo + i * chunk
        ce = cs + chunk if cs + chunk < hi else hi
        s = 0xFFFFFFFF
        p = cs
        while p < ce:
            if o < outer:
                rs = o * src_row + src_off
                re = rs + run
                if re <= p:
                    o += 1
                elif p < rs:  # bytes no one needs here: checksummed only
                    q = rs if rs < ce else ce
                    s = ferro_crc32c_update(s, src + p, NULL, <size_t>(q - p), 0)
                    p = q
                else:
                    q = re if re < ce else ce
                    s = ferro_crc32c_update(s, src + p, dst + o * dst_row + dst_off + (p - rs),
                                            <size_t>(q - p), stream)
                    p = q
                    if p == re:
                        o += 1
            else:
                s = ferro_crc32c_update(s, src + p, NULL, <size_t>(ce - p), 0)
                p = ce
        crcs[i] = ~s


def copy_window(const uint8_t[::1] src, uint8_t[::1] dst, Py_ssize_t lo, Py_ssize_t hi,
                Py_ssize_t outer, Py_ssize_t src_row, Py_ssize_t dst_row, Py_ssize_t src_off,
                Py_ssize_t dst_off, Py_ssize_t run, uint32_t[::1] crcs, Py_ssize_t chunk,
                bint stream=False) -> None:
    """Read ``src[lo:hi]`` once: copy the part of each run inside it and checksum its chunks.

    Run ``o`` (``0 <= o < outer``) is ``src[o*src_row + src_off :][:run]`` and goes to
    ``dst[o*dst_row + dst_off :][:run]``. ``crcs[i]`` receives the CRC-32C of
    ``src[lo + i*chunk : min(lo + (i+1)*chunk, hi)]``; with an empty ``crcs`` nothing is
    checksummed and only the runs are copied. ``stream`` stores past the caches (large loads).

    Assumes valid input (``copy_plan.py`` validates): runs disjoint and in order, inside ``src``
    and ``dst``, ``0 <= lo <= hi <= len(src)``, and ``len(crcs)`` the chunks of ``[lo, hi)``.
    """
    cdef Py_ssize_t nchunks = crcs.shape[0]
    cdef uint32_t* c = &crcs[0] if nchunks else NULL
    cdef uint8_t* d = &dst[0] if dst.shape[0] else NULL
    if hi <= lo or src.shape[0] == 0 or (d == NULL and nchunks == 0):
        return
    with nogil:
        _window(&src[0], d, lo, hi, outer if d != NULL else 0, src_row, dst_row, src_off,
                dst_off, run, c, nchunks, chunk, stream)


def write_chunks(int fd, const uint8_t[::1] src, uint32_t[::1] crcs,
                 Py_ssize_t chunk) -> int:
    """Write all of ``src`` to ``fd``, chunk by chunk, each checksummed (into ``crcs[i]``) just
    before it is written, while it is in the cache; an empty ``crcs`` writes without checksums.
    Returns 0, or the ``errno`` of the write that failed. ``len(crcs)`` is 0 or the number of
    chunks of ``src`` (one for an empty ``src``)."""
    cdef Py_ssize_t n = src.shape[0], i = 0, lo = 0, hi, step = chunk if chunk > 0 else n
    cdef Py_ssize_t got
    cdef const uint8_t* p
    cdef int err = 0
    if n == 0:
        if crcs.shape[0]:
            crcs[0] = 0
        return 0
    p = &src[0]
    with nogil:
        while lo < n and err == 0:
            hi = lo + step if lo + step < n else n
            if crcs.shape[0]:
                crcs[i] = ~ferro_crc32c_update(0xFFFFFFFF, p + lo, NULL, <size_t>(hi - lo), 0)
            while lo < hi:
                got = c_write(fd, p + lo, <size_t>(hi - lo))
                if got < 0:
                    if errno == EINTR:
                        continue
                    err = errno
                    break
                lo += got
            i += 1
    return err
