# The C declarations of the engine's collective steps (_steps.h, with the split allreduce of
# _split.h), for _slots.pyx, after _engine.pxi, whose layout and wait types they use; and the
# signatures that name the capsules passed between the two distributions.

cdef extern from "_steps.h" nogil:
    ctypedef int (*ferro_fold_fn)(int code, void* out, const void** inputs, Py_ssize_t count,
                                  Py_ssize_t n, int op, double mean_divisor)
    ctypedef struct ferro_split:
        int active
        uint32_t* bases
        unsigned char* scratch
    size_t FERRO_SPLIT_CHUNK_MAX
    ctypedef struct ferro_put:
        size_t small_bytes
        double slow_ns
    double ferro_copy_ns_per_kib(double (*now)() noexcept nogil)
    ctypedef struct ferro_slots:
        unsigned char* base
        ferro_layout L
        int n, me
        uint32_t step
        unsigned long long sent
        size_t hlen
        ferro_policy pol
        uint32_t* failed
        ferro_fold_fn fold
        int clock
        double waited
        size_t split_min
        ferro_put put
        ferro_split split
    ctypedef struct ferro_slots_api:
        int (*allreduce)(void* ctx, const unsigned char* header, size_t hlen, uint64_t hash,
                         uint32_t seq, const void* src, size_t nbytes, void* out,
                         Py_ssize_t count, int code, int op, double mean_divisor,
                         double deadline) noexcept
    uint32_t FERRO_SEQ_OFF
    uint64_t ferro_header_hash(const unsigned char* h, size_t len)
    ferro_slot_head* ferro_slots_slot(ferro_slots* s, int rank, uint32_t step)
    void ferro_slots_publish(ferro_slots* s, uint32_t step)
    int ferro_slots_wait_all(ferro_slots* s, uint32_t step, double deadline)
    int ferro_slots_agree(ferro_slots* s)
    int ferro_slots_exchange(ferro_slots* s, const unsigned char* header, size_t hlen, int patch,
                             uint64_t hash, uint32_t seq, const unsigned char* src,
                             size_t nbytes, size_t span, double deadline)
    size_t ferro_slots_rot(const ferro_slots* s, uint32_t step, size_t span)
    int ferro_slots_fold(ferro_slots* s, void* out, size_t offset, Py_ssize_t count, int code,
                         int op, double mean_divisor)
    void ferro_slots_copy(ferro_slots* s, void* out, const void* src, size_t nbytes, int root)
    int ferro_slots_sync(ferro_slots* s, double deadline)
    void ferro_slots_api_init(ferro_slots_api* api, ferro_slots* s)
    int ferro_split_resume(ferro_slots* s, double deadline)
    int ferro_split_can(const ferro_slots* s, size_t nbytes, Py_ssize_t count)
    int ferro_split_start(ferro_slots* s, const unsigned char* header, size_t hlen,
                          uint64_t hash, uint32_t seq, const void* src, size_t nbytes, void* out,
                          Py_ssize_t count, int code, int op, double mean_divisor, int gather,
                          double deadline)
    int ferro_stream_start(ferro_slots* s, const unsigned char* header, size_t hlen,
                           uint64_t hash, uint32_t seq, const void* src, size_t nbytes,
                           void* out, double deadline)

#: the capsule name (the C signature) of the fold :meth:`SlotEngine.set_fold` takes: ``out`` =
#: the rank-order fold of ``count`` inputs of ``n`` items of dtype ``code`` with op ``op``
#: (MEAN's divide fused when ``mean_divisor`` > 0); 0, or -1 for an unknown dtype code
FOLD_SIGNATURE = ("int (int code, void *out, const void **inputs, Py_ssize_t count, "
                  "Py_ssize_t n, int op, double mean_divisor)")
cdef bytes _FOLD_NAME = FOLD_SIGNATURE.encode()
#: the capsule name of :meth:`SlotEngine.api`: the layout of the table it holds (``ctx`` is
#: passed back to each function; ``hash`` is :func:`header_hash` of the header with sequence
#: number 0, ``seq`` is patched in; each returns OK, TIMEOUT, FAILED, MISMATCH, or -1 for a
#: dtype code the fold has no kernel for; nothing is folded or copied unless OK). The functions
#: are called with the GIL held and release it while they wait beyond a short spin.
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
