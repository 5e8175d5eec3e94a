/* The engine's collective steps, in C: one rank's view of every rank's slots and step words.
 *
 * A rank takes part in step s by writing its slot s % 2 (a collective header, optional
 * cross-memory addresses and data), then publishing step = s (release); it waits until every
 * rank has published s (acquire). Slot s % 2 is free again at step s + 2: a rank publishes s + 1
 * only after reading everyone's step-s slots. Each rank's control line also carries a hash of
 * its step's header (by step parity, so a peer already on the next step cannot overwrite the
 * one being compared), published with the step: a rank compares every peer's header by reading
 * the one cache line it waited on, and the slots' headers only when a hash differs. A barrier
 * thus moves one cache line each way.
 *
 * _slots.pyx wraps these for Python (SlotEngine) and exports the one-call steps to other
 * extensions as a table of C functions in a capsule (ferro_slots_api): ferro-collective's
 * compiled dispatcher calls them with no Python object in between. Callers validate sizes;
 * these functions trust them.
 */
#ifndef FERRO_STEPS_H
#define FERRO_STEPS_H

#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "_layout.h"
#include "_put.h"
#include "_sync.h"

/* where a collective header holds its 32-bit little-endian sequence number */
#define FERRO_SEQ_OFF 24u
/* the one-call steps' GIL: checks of the peers' step words before it is released, and the data
 * size from which a step runs without it from the start */
#define FERRO_GIL_SPINS 48
#define FERRO_GIL_BYTES 65536u

/* out = the rank-order fold of count inputs of n items of dtype code with op (MEAN's divide
 * fused when mean_divisor > 0); 0, or -1 for an unknown dtype code. The collectives' kernel. */
typedef int (*ferro_fold_fn)(int code, void* out, const void** inputs, Py_ssize_t count,
                             Py_ssize_t n, int op, double mean_divisor);

/* A split reduction under way (_split.h): its buffers and kernel, and the next action of its
 * pipeline, so that a step whose waits ended at the soft deadline resumes where it stopped. */
typedef struct {
    int kind;                  /* FERRO_KIND_SPLIT (reductions) or FERRO_KIND_STREAM (all_gather) */
    int active;                /* under way: its last wait ended early (2: the start's wait) */
    int gather;                /* split: an allreduce (1) or a reduce_scatter (0) */
    int aliased;               /* out overlaps src (an in-place call) */
    const unsigned char* src;
    unsigned char* out;
    size_t out_shift;          /* a reduce_scatter's out holds the data from this byte on */
    size_t itemsize, chunk;    /* chunk: bytes of a part moved and folded at once */
    size_t in_stride;          /* bytes of a part's input sub-ring (in_ring chunks) */
    Py_ssize_t count;          /* items of the whole reduction */
    int code, op, nchunks, next;
    int in_ring, out_ring;     /* positions of the input sub-rings and of the result ring */
    double mean_divisor;
    uint32_t step;             /* the call's first step (its inputs' slots; results: step + 1) */
    uint32_t* bases;           /* every rank's in_base, out_base, g_base, read at the start (3n) */
    unsigned char* scratch;    /* a chunk (FERRO_SPLIT_CHUNK_MAX + 256 bytes) folded first */
} ferro_split;

typedef struct {
    unsigned char* base;
    ferro_layout L;
    int n, me;
    uint32_t step;             /* the last step this rank took */
    unsigned long long sent;   /* payload bytes this rank wrote into its slot */
    size_t hlen;               /* the header length of the last step */
    ferro_policy pol;
    uint32_t* failed;          /* this process's failure flag */
    ferro_fold_fn fold;        /* set once by the collectives (NULL: no one-call folds) */
    int clock;                 /* time the waits for peers (a timeline is on) */
    double waited;             /* seconds this rank's steps waited for their peers (clock on) */
    size_t split_min;          /* whole reductions of at least this many bytes split (0: never) */
    ferro_put put;             /* how data goes into shared memory (_put.h) */
    size_t rot;                /* where the last step's data starts in every rank's slot data */
    ferro_split split;
} ferro_slots;

/* What other extensions call: the one-call steps on ctx (a ferro_slots), called with the GIL
 * held: they release it while they wait beyond a short spin (FERRO_GIL_SPINS checks of the
 * peers' step words: a peer that arrives within about a microsecond costs no GIL round trip)
 * and for the whole step beyond FERRO_GIL_BYTES of data. Each returns FERRO_OK, FERRO_TIMEOUT,
 * FERRO_FAILED or FERRO_MISMATCH (nothing folded or copied unless OK), or -1 when the fold has
 * no kernel for the dtype code. hash: ferro_header_hash of the header with sequence number 0;
 * seq is patched into the header at FERRO_SEQ_OFF. */
typedef struct {
    void* ctx;
    int (*fold)(void* ctx, const unsigned char* header, size_t hlen, uint64_t hash, uint32_t seq,
                const void* src, size_t nbytes, void* out, size_t offset, Py_ssize_t count,
                int code, int op, double mean_divisor, double deadline);
    int (*copy)(void* ctx, const unsigned char* header, size_t hlen, uint64_t hash, uint32_t seq,
                const void* src, size_t nbytes, void* out, int root, double deadline);
    int (*barrier)(void* ctx, const unsigned char* header, size_t hlen, uint64_t hash,
                   uint32_t seq, double deadline);
    /* a whole allreduce (out = the fold of count items of every rank's src): split
     * (_split.h) from the engine's split_min bytes, else fold */
    int (*allreduce)(void* ctx, const unsigned char* header, size_t hlen, uint64_t hash,
                     uint32_t seq, const void* src, size_t nbytes, void* out, Py_ssize_t count,
                     int code, int op, double mean_divisor, double deadline);
} ferro_slots_api;

static inline ferro_slot_head* ferro_slots_slot(ferro_slots* s, int rank, uint32_t step) {
    return ferro_slot_of(s->base, &s->L, rank, step);
}

/* FNV-1a (64 bits) over the header without its sequence number: the same for every call of one
 * signature, so a caller computes it once per plan and ferro_header_seq mixes the number in. */
static inline uint64_t ferro_header_hash(const unsigned char* h, size_t len) {
    uint64_t x = 14695981039346656037ull;
    size_t i;
    for (i = 0; i < len; i++)
        if (i - FERRO_SEQ_OFF >= 4u) x = (x ^ h[i]) * 1099511628211ull;
    return x;
}

static inline uint64_t ferro_header_seq(uint64_t hash, uint32_t seq) {
    return hash ^ ((uint64_t)seq * 0x9E3779B97F4A7C15ull);
}

static inline uint32_t ferro_read_seq(const unsigned char* h, size_t len) {
    if (len < FERRO_SEQ_OFF + 4u) return 0;
    return (uint32_t)h[FERRO_SEQ_OFF] | (uint32_t)h[FERRO_SEQ_OFF + 1] << 8
        | (uint32_t)h[FERRO_SEQ_OFF + 2] << 16 | (uint32_t)h[FERRO_SEQ_OFF + 3] << 24;
}

static inline void ferro_slots_publish(ferro_slots* s, uint32_t step) {
    ferro_ctrl* c = ferro_ctrl_of(s->base, &s->L, s->me);
    ferro_publish(&c->step, step, &c->sleepers);
}

static inline int ferro_slots_wait_all(ferro_slots* s, uint32_t step, double deadline) {
    int j, rc = FERRO_OK;
    ferro_ctrl* c;
    double t0 = s->clock ? ferro_now() : 0.0;
    for (j = 0; j < s->n && rc == FERRO_OK; j++) {
        if (j == s->me) continue;
        c = ferro_ctrl_of(s->base, &s->L, j);
        rc = ferro_wait(&s->pol, &c->step, step, FERRO_UNTIL_REACHED, &c->sleepers, deadline,
                        s->failed, NULL, 0.0);
    }
    if (s->clock) s->waited += ferro_now() - t0;
    return rc;
}

/* ferro_slots_wait_all for a caller holding the GIL (gil = 1): a short spin first, then the
 * wait without it. */
static inline int ferro_slots_wait_gil(ferro_slots* s, uint32_t step, double deadline, int gil) {
    int j, k, rc;
    PyThreadState* st;
    if (!gil) return ferro_slots_wait_all(s, step, deadline);
    for (k = 0, j = 0; k < FERRO_GIL_SPINS; k++) {
        while (j < s->n && (j == s->me || (int32_t)(ferro_load(
                   &ferro_ctrl_of(s->base, &s->L, j)->step) - step) >= 0))
            j++;
        if (j == s->n) return FERRO_OK;
        ferro_pause();
    }
    st = PyEval_SaveThread();
    rc = ferro_slots_wait_all(s, step, deadline);
    PyEval_RestoreThread(st);
    return rc;
}

/* Whether every rank's header of this step equals this rank's: the published hashes first
 * (on the line each rank waited on), the slots' headers only when a hash differs. */
static inline int ferro_slots_agree(ferro_slots* s) {
    int j, p = (int)(s->step & 1u);
    uint64_t mine = ferro_ctrl_of(s->base, &s->L, s->me)->head_hash[p];
    ferro_slot_head* own = ferro_slots_slot(s, s->me, s->step);
    for (j = 0; j < s->n; j++) {
        if (j == s->me) continue;
        if (__atomic_load_n(&ferro_ctrl_of(s->base, &s->L, j)->head_hash[p], __ATOMIC_RELAXED)
                == mine)
            continue;
        if (memcmp(ferro_slots_slot(s, j, s->step)->header, own->header, s->hlen) != 0)
            return 0;
    }
    return 1;
}

#include "_onestep.h"

/* The next step's first half: header (seq patched in at FERRO_SEQ_OFF when patch; hash: its
 * hash without the number) and nbytes at src into this rank's slot, at ferro_slots_rot of
 * span (the call's bytes per rank; 0: at the start of the slot, as exchange's callers expect);
 * publish (with the header's hash). ferro_slots_meet ends it. */
static inline void ferro_slots_post(ferro_slots* s, const unsigned char* header, size_t hlen,
                                    int patch, uint64_t hash, uint32_t seq,
                                    const unsigned char* src, size_t nbytes, size_t span) {
    uint32_t step = s->step + 1;
    ferro_slot_head* mine = ferro_slots_slot(s, s->me, step);
    s->split.active = 0;
    s->rot = ferro_slots_rot(s, step, span);
    memcpy(mine->header, header, hlen);
    if (patch && hlen >= FERRO_SEQ_OFF + 4u) {
        mine->header[FERRO_SEQ_OFF] = seq & 0xFF;
        mine->header[FERRO_SEQ_OFF + 1] = (seq >> 8) & 0xFF;
        mine->header[FERRO_SEQ_OFF + 2] = (seq >> 16) & 0xFF;
        mine->header[FERRO_SEQ_OFF + 3] = (seq >> 24) & 0xFF;
    } else {
        hash = ferro_header_hash(header, hlen);
        seq = ferro_read_seq(header, hlen);
    }
    if (nbytes) {
        ferro_put_choose(&s->put, nbytes, ferro_slots_places(s, span) > 1);
        ferro_put_copy(&s->put, ferro_slot_data(mine) + s->rot, src, nbytes);
    }
    s->step = step;
    s->hlen = hlen;
    s->sent += nbytes;
    __atomic_store_n(&ferro_ctrl_of(s->base, &s->L, s->me)->head_hash[step & 1u],
                     ferro_header_seq(hash, seq), __ATOMIC_RELAXED);
    ferro_slots_publish(s, step);
}

/* The posted step's second half: wait for every rank until deadline (gil: the caller holds the
 * GIL, see ferro_slots_wait_gil), compare headers. */
static inline int ferro_slots_meet(ferro_slots* s, double deadline, int gil) {
    int rc = ferro_slots_wait_gil(s, s->step, deadline, gil);
    if (rc == FERRO_OK && !ferro_slots_agree(s)) return FERRO_MISMATCH;
    return rc;
}

/* A whole step for a caller without the GIL: ferro_slots_post (a general-path call places its
 * data for span as its compiled twin does), then ferro_slots_meet. */
static inline int ferro_slots_exchange(ferro_slots* s, const unsigned char* header, size_t hlen,
                                       int patch, uint64_t hash, uint32_t seq,
                                       const unsigned char* src, size_t nbytes, size_t span,
                                       double deadline) {
    ferro_slots_post(s, header, hlen, patch, hash, seq, src, nbytes, span);
    return ferro_slots_meet(s, deadline, 0);
}

/* A step without slot writes (every rank has finished the last one). */
static inline int ferro_slots_sync(ferro_slots* s, double deadline) {
    s->step += 1;
    s->rot = 0;
    ferro_slots_publish(s, s->step);
    return ferro_slots_wait_all(s, s->step, deadline);
}

#include "_split.h"
#include "_stream.h"

/* ---- the exported one-call steps (ferro_slots_api), called with the GIL held ---- */

static int ferro_api_fold(void* ctx, const unsigned char* header, size_t hlen, uint64_t hash,
                          uint32_t seq, const void* src, size_t nbytes, void* out, size_t offset,
                          Py_ssize_t count, int code, int op, double mean_divisor,
                          double deadline) {
    ferro_slots* s = (ferro_slots*)ctx;
    int rc, big = nbytes > FERRO_GIL_BYTES;
    PyThreadState* st = big ? PyEval_SaveThread() : NULL;
    ferro_slots_post(s, header, hlen, 1, hash, seq, (const unsigned char*)src, nbytes, nbytes);
    rc = ferro_slots_meet(s, deadline, !big);
    if (rc == FERRO_OK && count > 0) rc = ferro_slots_fold(s, out, offset, count, code, op,
                                                          mean_divisor);
    if (big) PyEval_RestoreThread(st);
    return rc;
}

static int ferro_api_copy(void* ctx, const unsigned char* header, size_t hlen, uint64_t hash,
                          uint32_t seq, const void* src, size_t nbytes, void* out, int root,
                          double deadline) {
    ferro_slots* s = (ferro_slots*)ctx;
    int rc, big = nbytes > FERRO_GIL_BYTES;
    PyThreadState* st = big ? PyEval_SaveThread() : NULL;
    ferro_slots_post(s, header, hlen, 1, hash, seq, (const unsigned char*)src,
                     root < 0 || root == s->me ? nbytes : 0, nbytes);
    ferro_slots_copy_own(s, out, src, nbytes, root);  /* while the peers arrive */
    rc = ferro_slots_meet(s, deadline, !big);
    if (rc == FERRO_OK) ferro_slots_copy_peers(s, out, nbytes, root);
    if (big) PyEval_RestoreThread(st);
    return rc;
}

static int ferro_api_barrier(void* ctx, const unsigned char* header, size_t hlen, uint64_t hash,
                             uint32_t seq, double deadline) {
    ferro_slots_post((ferro_slots*)ctx, header, hlen, 1, hash, seq, NULL, 0, 0);
    return ferro_slots_meet((ferro_slots*)ctx, deadline, 1);
}

static int ferro_api_allreduce(void* ctx, const unsigned char* header, size_t hlen,
                               uint64_t hash, uint32_t seq, const void* src, size_t nbytes,
                               void* out, Py_ssize_t count, int code, int op,
                               double mean_divisor, double deadline) {
    ferro_slots* s = (ferro_slots*)ctx;
    int rc;
    PyThreadState* st;
    if (!ferro_split_fits(s, nbytes, count))
        return ferro_api_fold(ctx, header, hlen, hash, seq, src, nbytes, out, 0, count, code, op,
                              mean_divisor, deadline);
    st = PyEval_SaveThread();
    rc = ferro_split_start(s, header, hlen, hash, seq, src, nbytes, out, count, code, op,
                           mean_divisor, 1, deadline);
    PyEval_RestoreThread(st);
    return rc;
}

static inline void ferro_slots_api_init(ferro_slots_api* api, ferro_slots* s) {
    api->ctx = s;
    api->fold = ferro_api_fold;
    api->copy = ferro_api_copy;
    api->barrier = ferro_api_barrier;
    api->allreduce = ferro_api_allreduce;
}

#endif
