# ferro/engine.pxd: ferro/engine.h for Cython. With ferro_backend.get_include() on Cython's
# include path: `from ferro.engine cimport *`; C compiles the calls against the header itself,
# so a declaration here that drifted from it fails to compile.

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

cdef extern from "ferro/engine.h" nogil:
    unsigned FERRO_ENGINE_ABI_MAJOR
    unsigned FERRO_ENGINE_ABI_MINOR
    const char* FERRO_ENGINE_CAPSULE
    int64_t FERRO_TICKET_NOW
    int FERRO_ANY_SOURCE

    ctypedef enum ferro_status:
        FERRO_OK, FERRO_TIMEOUT, FERRO_FAILED, FERRO_MISMATCH, FERRO_INVALID, FERRO_CLOSED,
        FERRO_BUSY, FERRO_UNSUPPORTED, FERRO_NOMEM, FERRO_VERSION

    ctypedef enum ferro_dtype:
        FERRO_FLOAT32, FERRO_FLOAT64, FERRO_INT8, FERRO_INT16, FERRO_INT32, FERRO_INT64,
        FERRO_UINT8, FERRO_UINT16, FERRO_UINT32, FERRO_UINT64, FERRO_FLOAT16, FERRO_BFLOAT16,
        FERRO_BOOL, FERRO_DTYPE_COUNT

    ctypedef enum ferro_op:
        FERRO_SUM, FERRO_PROD, FERRO_MAX, FERRO_MIN, FERRO_BAND, FERRO_BOR, FERRO_BXOR,
        FERRO_AVG, FERRO_OP_COUNT

    ctypedef void (*ferro_wait_hook)(void* ctx, int waiting) noexcept nogil

    ctypedef struct ferro_opts:
        uint32_t size
        uint32_t flags
        double timeout
        int64_t ticket
        int32_t ndim
        const int64_t* dims
        const char* type_name
        ferro_wait_hook wait_hook
        void* wait_ctx

    ctypedef struct ferro_comm:
        pass

    ctypedef void (*ferro_stall_fn)(void* ctx, const char* message) noexcept nogil

    ctypedef struct ferro_engine_api:
        uint32_t abi_major, abi_minor
        size_t size
        int (*rank)(const ferro_comm* c) noexcept nogil
        int (*world_size)(const ferro_comm* c) noexcept nogil
        double (*default_timeout)(const ferro_comm* c) noexcept nogil
        void (*retain)(ferro_comm* c) noexcept nogil
        void (*release)(ferro_comm* c) noexcept nogil
        int (*close)(ferro_comm* c) noexcept nogil
        int64_t (*reserve)(ferro_comm* c) noexcept nogil
        int (*skip)(ferro_comm* c, int64_t ticket) noexcept nogil
        void (*set_stall_report)(ferro_comm* c, ferro_stall_fn fn, void* ctx) noexcept nogil
        int (*barrier)(ferro_comm* c, const ferro_opts* o) noexcept nogil
        int (*allreduce)(ferro_comm* c, const void* send, void* recv, size_t count, int dtype,
                         int op, const ferro_opts* o) noexcept nogil
        int (*reduce)(ferro_comm* c, const void* send, void* recv, size_t count, int dtype,
                      int op, int root, const ferro_opts* o) noexcept nogil
        int (*reduce_scatter)(ferro_comm* c, const void* send, void* recv, size_t recv_count,
                              int dtype, int op, const ferro_opts* o) noexcept nogil
        int (*all_gather)(ferro_comm* c, const void* send, void* recv, size_t send_count,
                          int dtype, const ferro_opts* o) noexcept nogil
        int (*gather)(ferro_comm* c, const void* send, void* recv, size_t send_count, int dtype,
                      int root, const ferro_opts* o) noexcept nogil
        int (*scatter)(ferro_comm* c, const void* send, void* recv, size_t recv_count,
                       int dtype, int root, const ferro_opts* o) noexcept nogil
        int (*broadcast)(ferro_comm* c, const void* send, void* recv, size_t count, int dtype,
                         int root, const ferro_opts* o) noexcept nogil
        int (*all_to_all)(ferro_comm* c, const void* send, void* recv, size_t count, int dtype,
                          const ferro_opts* o) noexcept nogil
        int (*send)(ferro_comm* c, const void* buf, size_t nbytes, int dst, uint64_t tag,
                    const ferro_opts* o) noexcept nogil
        int (*recv)(ferro_comm* c, void* buf, size_t nbytes, int src, uint64_t tag,
                    int* source, const ferro_opts* o) noexcept nogil
        const char* (*last_error)() noexcept nogil
        const char* (*status_name)(int status) noexcept nogil

    const ferro_engine_api* ferro_api(const ferro_comm* c)
    ferro_comm* ferro_attach(void* handle, char* why, size_t why_len)
