/* ferro/engine.h: the door into ferro's same-host engine, for C and C++.
 *
 * The engine is the shared-memory transport a ferro_backend.ShmBackend maps on one host: every
 * rank of a job (or of a subgroup) shares one segment, and a collective is a few steps through
 * it. This header is the whole of what a client needs to run collectives on it from C or C++:
 * a communicator handle (ferro_comm), the calls on raw buffers, their status codes and the
 * message of the last error. No call needs Python or the GIL; they may run in any thread.
 *
 * Where a communicator comes from: ferro_backend.engine.comm_capsule(backend) in Python (a
 * ShmBackend, or a subgroup of one whose members share its engine) returns a capsule named
 * FERRO_ENGINE_CAPSULE; its pointer is a ferro_comm*. ferro_attach() checks that the engine
 * speaks this header's ABI and takes a reference (ferro/engine_python.h does both from the
 * capsule). Every call is reached through the communicator's table:
 *
 *     char why[256];
 *     ferro_comm* c = ferro_attach(PyCapsule_GetPointer(cap, FERRO_ENGINE_CAPSULE), why, 256);
 *     if (c == NULL) { ...why says what is wrong... }
 *     const ferro_engine_api* f = ferro_api(c);
 *     int rc = f->allreduce(c, x, x, n, FERRO_FLOAT32, FERRO_SUM, NULL);
 *     if (rc != FERRO_OK) fprintf(stderr, "%s: %s\n", f->status_name(rc), f->last_error());
 *     f->release(c);
 *
 * Versions: FERRO_ENGINE_ABI_MAJOR changes when a call changes meaning or the table changes
 * layout; a client built against another major version is refused at ferro_attach (with a
 * message, never a crash). FERRO_ENGINE_ABI_MINOR grows when calls are appended to the table;
 * a client needs an engine whose minor version is at least its own.
 *
 * THE THREAD RULE. A communicator runs one collective at a time, in the order of their
 * tickets; every rank must make the same collectives in the same order.
 *   - A call takes its ticket when it is made (FERRO_TICKET_NOW), or runs on one reserved
 *     earlier with reserve() (opts->ticket), and waits until every call of an earlier ticket has
 *     finished (waiting counts against its own timeout).
 *   - Calls from several threads at once must reserve their tickets, in the same order on every
 *     rank: an order that thread timing decides differs between ranks. So two calls with
 *     FERRO_TICKET_NOW may not run at once from two threads: the second returns FERRO_BUSY at
 *     once, naming both (nothing published, no ticket taken).
 *   - Every reserved ticket must be run (or given back with skip()), once: the calls behind it
 *     wait for it. A ticket used twice, or never reserved, is FERRO_INVALID.
 *   - send() and recv() take no ticket: they may run at once with collectives and with each
 *     other, from any thread. Messages from one rank to another on one tag arrive in the order
 *     they were sent.
 *   - rank(), world_size(), default_timeout(), last_error(), status_name(), retain() and
 *     release() may run at any time from any thread. close() may too: calls in flight on other
 *     threads then end with FERRO_CLOSED.
 *
 * Results: every rank that receives a reduction gets the same bits (each element is folded in
 * rank order; float16 and bfloat16 are accumulated in float32 and rounded once). A call that
 * does not return FERRO_OK leaves its output undefined. After FERRO_TIMEOUT or FERRO_FAILED the
 * communicator is broken (the ranks no longer agree on its steps): every later call returns the
 * same status. FERRO_MISMATCH (the ranks called different collectives, dtypes, shapes, ops or
 * roots) is found on every rank before any data is used, and the communicator goes on.
 */
#ifndef FERRO_ENGINE_H
#define FERRO_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FERRO_ENGINE_ABI_MAJOR 1u
#define FERRO_ENGINE_ABI_MINOR 0u
/* the name of the capsule that holds a ferro_comm* */
#define FERRO_ENGINE_CAPSULE "ferro_backend.engine.comm"
/* the first word of every communicator */
#define FERRO_ENGINE_MAGIC 0xFE770D00u

/* What a call returns. */
typedef enum ferro_status {
    FERRO_OK = 0,
    FERRO_TIMEOUT = 1,      /* the deadline passed (the message names the ranks not arrived) */
    FERRO_FAILED = 2,       /* a peer died, closed or aborted (the message says which, if known) */
    FERRO_MISMATCH = 3,     /* the ranks' calls disagree (the message names what each called) */
    FERRO_INVALID = 4,      /* a bad argument on this rank (nothing was published) */
    FERRO_CLOSED = 5,       /* this communicator was closed */
    FERRO_BUSY = 6,         /* the thread rule was broken (see above) */
    FERRO_UNSUPPORTED = 7,  /* the engine cannot run this call (a dtype/op pair, a size) */
    FERRO_NOMEM = 8,
    FERRO_VERSION = 9       /* the client and the engine speak different ABIs (ferro_attach) */
} ferro_status;

/* Element types. bool is one byte, 0 or 1; float16 is IEEE binary16, bfloat16 the top half of
 * a binary32. */
typedef enum ferro_dtype {
    FERRO_FLOAT32 = 0,
    FERRO_FLOAT64 = 1,
    FERRO_INT8 = 2,
    FERRO_INT16 = 3,
    FERRO_INT32 = 4,
    FERRO_INT64 = 5,
    FERRO_UINT8 = 6,
    FERRO_UINT16 = 7,
    FERRO_UINT32 = 8,
    FERRO_UINT64 = 9,
    FERRO_FLOAT16 = 10,
    FERRO_BFLOAT16 = 11,
    FERRO_BOOL = 12,
    FERRO_DTYPE_COUNT = 13
} ferro_dtype;

/* Reductions. AVG: the sum divided by the world size (float dtypes only); BAND, BOR, BXOR:
 * integer and bool dtypes only; bool takes nothing else. Integer sums wrap. MAX and MIN
 * propagate NaN. */
typedef enum ferro_op {
    FERRO_SUM = 0,
    FERRO_PROD = 1,
    FERRO_MAX = 2,
    FERRO_MIN = 3,
    FERRO_BAND = 4,
    FERRO_BOR = 5,
    FERRO_BXOR = 6,
    FERRO_AVG = 7,
    FERRO_OP_COUNT = 8
} ferro_op;

/* opts->ticket: take the next ticket when the call is made */
#define FERRO_TICKET_NOW (-1)
/* recv's src: a message from any rank */
#define FERRO_ANY_SOURCE (-1)

/* opts->wait_hook: called as hook(ctx, 1) once a call is about to wait (beyond a short spin)
 * or to move more than 64 KiB, and as hook(ctx, 0) before it returns if it was called with 1;
 * from the calling thread. A caller holding a lock others need while it waits (Python's GIL)
 * lets it go there and takes it back. */
typedef void (*ferro_wait_hook)(void* ctx, int waiting);

/* A call's options; NULL means all defaults. Fill with FERRO_OPTS_INIT, then set fields. */
typedef struct ferro_opts {
    uint32_t size;          /* sizeof(ferro_opts) as the client knows it (FERRO_OPTS_INIT) */
    uint32_t flags;         /* bits 0-15, FERRO_OPTS_SPAN(n): this collective is the first of a
                             * call of the client's that takes n tickets in all (0: one), as a
                             * compressed call that always reserves a block; its header says so,
                             * and where the ranks' calls disagree (FERRO_MISMATCH), a rank
                             * whose call took fewer tickets than a peer's, and that reserved
                             * none after it, gives back the difference, so that the next call
                             * is the next call on every rank. Bits 16-23,
                             * FERRO_OPTS_CALL(code), and 24-31, FERRO_OPTS_OP(wire): the
                             * collective and op codes its header names instead of its own (0:
                             * its own), so that a client's call made of several collectives
                             * (a multi-node job's stages) publishes in its first one what was
                             * called, which the ranks compare (op wire codes 1-8: SUM, MEAN,
                             * MAX, MIN, PRODUCT, BAND, BOR, BXOR) */
    double timeout;         /* seconds; 0: the communicator's default; INFINITY: none (a
                             * call times out no sooner, and at most two of the kernel's
                             * coarse clock ticks later: 8 ms with 4 ms ticks) */
    int64_t ticket;         /* FERRO_TICKET_NOW, or one reserve() returned */
    int32_t ndim;           /* the shape the call's header names for mismatch detection: */
    const int64_t* dims;    /*   ndim dims (0 of them: a scalar); NULL: one dim, the count */
    const char* type_name;  /* the element type it names (NULL: the dtype's, numpy's dtype.str
                             * as "<f4"): a copy of a type the engine does not know runs as
                             * FERRO_UINT8 bytes and names its own type here (at most 8 chars) */
    ferro_wait_hook wait_hook;  /* NULL: none */
    void* wait_ctx;
} ferro_opts;

#define FERRO_OPTS_SPAN(n) ((uint32_t)(n) & 0xFFFFu)
#define FERRO_OPTS_CALL(code) (((uint32_t)(code) & 0xFFu) << 16)
#define FERRO_OPTS_OP(wire) (((uint32_t)(wire) & 0xFFu) << 24)

#define FERRO_OPTS_INIT {sizeof(ferro_opts), 0u, 0.0, FERRO_TICKET_NOW, 0, NULL, NULL, NULL, NULL}

typedef struct ferro_comm ferro_comm;

/* A report while a call waits: called once per call, from the waiting thread, when half the
 * call's timeout has passed (the message names the ranks not arrived). */
typedef void (*ferro_stall_fn)(void* ctx, const char* message);

/* The calls. Counts are items of dtype; every buffer holds what its count says. Collective
 * calls: `send` and `recv` may be the same buffer where the call says so (in place), never
 * otherwise overlap. */
typedef struct ferro_engine_api {
    uint32_t abi_major, abi_minor;
    size_t size;                                   /* sizeof(ferro_engine_api) of the engine */

    /* ---- the communicator */
    int (*rank)(const ferro_comm* c);
    int (*world_size)(const ferro_comm* c);
    double (*default_timeout)(const ferro_comm* c);
    void (*retain)(ferro_comm* c);                 /* one more reference */
    void (*release)(ferro_comm* c);                /* the last one frees it (and its mapping) */
    int (*close)(ferro_comm* c);                   /* every later call: FERRO_CLOSED */
    int64_t (*reserve)(ferro_comm* c);             /* the next ticket (see THE THREAD RULE) */
    int (*skip)(ferro_comm* c, int64_t ticket);    /* give back a reserved ticket unused */
    void (*set_stall_report)(ferro_comm* c, ferro_stall_fn fn, void* ctx);

    /* ---- collectives */
    int (*barrier)(ferro_comm* c, const ferro_opts* o);
    /* recv = the fold of every rank's send (count items); send == recv: in place */
    int (*allreduce)(ferro_comm* c, const void* send, void* recv, size_t count, int dtype,
                     int op, const ferro_opts* o);
    /* on root, recv = the fold (count items); elsewhere recv is not used (may be NULL) */
    int (*reduce)(ferro_comm* c, const void* send, void* recv, size_t count, int dtype, int op,
                  int root, const ferro_opts* o);
    /* send: world_size * recv_count items; recv = block `rank` of the fold; in place where
     * recv == send + rank * recv_count items */
    int (*reduce_scatter)(ferro_comm* c, const void* send, void* recv, size_t recv_count,
                          int dtype, int op, const ferro_opts* o);
    /* recv: world_size blocks of send_count items, block r from rank r; in place where
     * send == recv + rank * send_count items */
    int (*all_gather)(ferro_comm* c, const void* send, void* recv, size_t send_count,
                      int dtype, const ferro_opts* o);
    /* recv (root only; NULL elsewhere): world_size blocks of send_count items */
    int (*gather)(ferro_comm* c, const void* send, void* recv, size_t send_count, int dtype,
                  int root, const ferro_opts* o);
    /* send (root only; NULL elsewhere): world_size blocks of recv_count items, block r for
     * rank r */
    int (*scatter)(ferro_comm* c, const void* send, void* recv, size_t recv_count, int dtype,
                   int root, const ferro_opts* o);
    /* recv = root's send (count items); send is read on root only (NULL elsewhere); on root
     * send == recv: in place */
    int (*broadcast)(ferro_comm* c, const void* send, void* recv, size_t count, int dtype,
                     int root, const ferro_opts* o);
    /* send: world_size blocks of count items, block r for rank r; recv: world_size blocks,
     * block r from rank r */
    int (*all_to_all)(ferro_comm* c, const void* send, void* recv, size_t count, int dtype,
                      const ferro_opts* o);

    /* ---- point-to-point (no ticket; see THE THREAD RULE) */
    /* nbytes of buf to rank dst on tag: returns once the message is in dst's ring (a message
     * larger than the room left waits for dst to take its pieces) */
    int (*send)(ferro_comm* c, const void* buf, size_t nbytes, int dst, uint64_t tag,
                const ferro_opts* o);
    /* the first message on tag from rank src (FERRO_ANY_SOURCE: from any rank) into buf,
     * which must hold exactly its nbytes (else FERRO_INVALID, the message dropped); *source
     * (may be NULL) = the sender */
    int (*recv)(ferro_comm* c, void* buf, size_t nbytes, int src, uint64_t tag, int* source,
                const ferro_opts* o);

    /* ---- errors */
    const char* (*last_error)(void);               /* this thread's last failed call's message */
    const char* (*status_name)(int status);        /* "FERRO_TIMEOUT", ... */
} ferro_engine_api;

/* The start of every communicator: all a client reads of it without the table. */
typedef struct ferro_comm_head {
    uint32_t magic;                  /* FERRO_ENGINE_MAGIC */
    uint32_t abi_major, abi_minor;   /* the engine's */
    uint32_t reserved;
    const ferro_engine_api* api;
} ferro_comm_head;

static inline const ferro_engine_api* ferro_api(const ferro_comm* c) {
    return ((const ferro_comm_head*)(const void*)c)->api;
}

/* (ferro_attach's message: text, then the two ABI versions when major is not 0) */
static inline size_t ferro_attach_put(char* why, size_t at, size_t len, const char* text) {
    while (*text != '\0' && at + 1 < len) why[at++] = *text++;
    return at;
}

static inline size_t ferro_attach_num(char* why, size_t at, size_t len, uint32_t v) {
    char digits[12];
    int d = 0;
    do {
        digits[d++] = (char)('0' + v % 10u);
        v /= 10u;
    } while (v != 0u);
    while (d > 0 && at + 1 < len) why[at++] = digits[--d];
    return at;
}

static inline void ferro_attach_why(char* why, size_t len, const char* text, uint32_t major,
                                    uint32_t minor) {
    size_t at;
    if (why == NULL || len == 0) return;
    at = ferro_attach_put(why, 0, len, text);
    if (major != 0u) {
        at = ferro_attach_put(why, at, len, " (engine ABI ");
        at = ferro_attach_num(why, at, len, major);
        at = ferro_attach_put(why, at, len, ".");
        at = ferro_attach_num(why, at, len, minor);
        at = ferro_attach_put(why, at, len, ", this client ");
        at = ferro_attach_num(why, at, len, FERRO_ENGINE_ABI_MAJOR);
        at = ferro_attach_put(why, at, len, ".");
        at = ferro_attach_num(why, at, len, FERRO_ENGINE_ABI_MINOR);
        at = ferro_attach_put(why, at, len, ")");
    }
    why[at] = '\0';
}

/* Check that `handle` (a capsule's pointer, see the top) is an engine communicator of this
 * header's ABI and take a reference (give it back with api->release); NULL with the reason in
 * `why` (why_len bytes, may be 0) otherwise. */
static inline ferro_comm* ferro_attach(void* handle, char* why, size_t why_len) {
    const ferro_comm_head* h = (const ferro_comm_head*)handle;
    if (h == NULL || h->magic != FERRO_ENGINE_MAGIC) {
        ferro_attach_why(why, why_len, "ferro_attach: not a ferro engine communicator", 0, 0);
        return NULL;
    }
    if (h->abi_major != FERRO_ENGINE_ABI_MAJOR || h->abi_minor + 1u < FERRO_ENGINE_ABI_MINOR + 1u
            || h->api == NULL || h->api->size < sizeof(ferro_engine_api)) {
        ferro_attach_why(why, why_len, "ferro_attach: this client was built against another "
                         "version of ferro's engine header; rebuild it against the installed "
                         "ferro-backend (ferro_backend.get_include())",
                         h->abi_major, h->abi_minor);
        return NULL;
    }
    h->api->retain((ferro_comm*)handle);
    return (ferro_comm*)handle;
}

#ifdef __cplusplus
}
#endif

#endif
