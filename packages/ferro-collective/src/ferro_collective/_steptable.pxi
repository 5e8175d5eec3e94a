# The C ABI _fastcall calls: ferro-backend's table of one-call engine steps (a capsule named by
# its layout, API_SIGNATURE, from SlotEngine.api(); called with the GIL held, they release it
# while they wait beyond a short spin) and the monotonic clock the engine's deadlines use.
# Declarations only, kept apart from the code that calls them.

from libc.stdint cimport uint32_t, uint64_t

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec* ts)
    int CLOCK_MONOTONIC

ctypedef int (*fold_step)(void* ctx, const unsigned char* header, size_t hlen, uint64_t hash,
                          uint32_t seq, const void* src, size_t nbytes, void* out, size_t offset,
                          Py_ssize_t count, int code, int op, double mean_divisor,
                          double deadline) noexcept
ctypedef int (*copy_step)(void* ctx, const unsigned char* header, size_t hlen, uint64_t hash,
                          uint32_t seq, const void* src, size_t nbytes, void* out, int root,
                          double deadline) noexcept
ctypedef int (*barrier_step)(void* ctx, const unsigned char* header, size_t hlen, uint64_t hash,
                             uint32_t seq, double deadline) noexcept

ctypedef int (*allreduce_step)(void* ctx, const unsigned char* header, size_t hlen,
                               uint64_t hash, uint32_t seq, const void* src, size_t nbytes,
                               void* out, Py_ssize_t count, int code, int op,
                               double mean_divisor, double deadline) noexcept

ctypedef struct slots_api:  # the layout API_SIGNATURE names
    void* ctx
    fold_step fold
    copy_step copy
    barrier_step barrier
    allreduce_step allreduce

#: the step table this module calls: ferro-backend's ``engine.API_SIGNATURE`` (a test holds the
#: two equal; the capsule is refused under any other name)
API_SIGNATURE = (
    "ferro_slots_api 3 (GIL held) {void *ctx; "
    "int (*fold)(void *ctx, const unsigned char *header, size_t hlen, uint64_t hash, "
    "uint32_t seq, const void *src, size_t nbytes, void *out, size_t offset, Py_ssize_t count, "
    "int code, int op, double mean_divisor, double deadline); "
    "int (*copy)(void *ctx, const unsigned char *header, size_t hlen, uint64_t hash, "
    "uint32_t seq, const void *src, size_t nbytes, void *out, int root, double deadline); "
    "int (*barrier)(void *ctx, const unsigned char *header, size_t hlen, uint64_t hash, "
    "uint32_t seq, double deadline); "
    "int (*allreduce)(void *ctx, const unsigned char *header, size_t hlen, uint64_t hash, "
    "uint32_t seq, const void *src, size_t nbytes, void *out, Py_ssize_t count, int code, "
    "int op, double mean_divisor, double deadline);}")
cdef bytes _API_NAME = API_SIGNATURE.encode()


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + 1e-9 * <double>ts.tv_nsec
