/* The engine's slots and step words, in C: one rank's view of every rank's (the base of the
 * collective steps, _steps.h, and their parts: _onestep.h, _split.h, _stream.h).
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
 * The door (door.c, ferro/engine.h) runs whole collectives on these steps; _comm.pyx offers
 * the steps one by one to Python (the collectives that only ferro's Python runs). Callers
 * validate sizes; these functions trust them. No Python: callable from any thread.
 */
#ifndef FERRO_SLOTS_H
#define FERRO_SLOTS_H

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "_fold.h"
#include "_header.h"
#include "_layout.h"
#include "_put.h"
#include "_sync.h"

/* A split reduction under way (_split.h): its buffers and kernel, and the next action of its
 * pipeline, so that a step whose waits ended at the soft deadline resumes where it stopped. */
struct ferro_slots;

typedef struct {
    int kind;                  /* FERRO_KIND_SPLIT (reductions) or FERRO_KIND_STREAM (all_gather) */
    /* its pipeline (ferro_split_run or ferro_stream_run), which a resumed call goes on with */
    int (*run)(struct ferro_slots* s, double deadline);
    int active;                /* under way: its last wait ended early (2: the start's wait) */
    int gather;                /* split: an allreduce (1) or a reduce_scatter (0) */
    int aliased;               /* out overlaps src (an in-place call) */
    const unsigned char* src;
    unsigned char* out;
    size_t out_shift;          /* a reduce_scatter's out holds the data from this byte on */
    size_t itemsize, chunk;    /* chunk: bytes of a part moved and folded at once */
    size_t in_stride;          /* bytes of a part's input sub-ring (in_ring chunks) */
    ptrdiff_t count;          /* items of the whole reduction */
    int code, op, nchunks, next;
    int in_ring, out_ring;     /* positions of the input sub-rings and of the result ring */
    double mean_divisor;
    uint32_t step;             /* the call's first step (its inputs' slots; results: step + 1) */
    uint32_t* bases;           /* every rank's in_base, out_base, g_base, read at the start (3n) */
    int wait_which, wait_k;    /* the progress wait under way, or the last that ended early:
                                * its word (FERRO_PROG_*) and chunk (-1: none; stall and
                                * timeout messages name the ranks behind it) */
    unsigned char* scratch;    /* a chunk (FERRO_SPLIT_CHUNK_MAX + 256 bytes) folded first */
} ferro_split;

typedef struct ferro_slots ferro_slots;
/* a report while a step waits (the door's: half of a call's timeout passed) */
typedef void (*ferro_slots_stall_fn)(ferro_slots* s);

struct ferro_slots {
    unsigned char* base;
    ferro_layout L;
    int n, me;
    uint32_t step;             /* the last step this rank took */
    unsigned long long sent;   /* payload bytes this rank wrote into its slot */
    size_t hlen;               /* the header length of the last step */
    ferro_policy pol;
    uint32_t* failed;          /* this process's failure flag */
    int clock;                 /* time the waits for peers (a timeline is on) */
    double waited;             /* seconds this rank's steps waited for their peers (clock on) */
    size_t split_min;          /* whole reductions of at least this many bytes split (0: never) */
    ferro_put put;             /* how data goes into shared memory (_put.h) */
    size_t rot;                /* where the last step's data starts in every rank's slot data */
    ferro_split split;
    /* the stall report of the call under way: before `soft`, waits end there, report (once),
     * then wait on until their own deadline; none while stall is NULL */
    ferro_slots_stall_fn stall;
    double soft;
    int reported;
    /* the wait hook of the call under way (ferro/engine.h): called with 1 once a wait goes
     * beyond FERRO_HOOK_SPINS checks (hooked then), with 0 by the door as the call ends */
    void (*hook)(void* ctx, int waiting);
    void* hook_ctx;
    int hooked;
};

/* checks of a word before a wait calls its hook (a peer that arrives within about a
 * microsecond costs no hook round trip) */
#define FERRO_HOOK_SPINS 48

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

/* Wait until *word has reached target (a peer's step or progress word), until deadline; with a
 * stall report set (the door's calls), first until s->soft, then report once and wait on. */
static inline int ferro_slots_wait_word(ferro_slots* s, uint32_t* word, uint32_t target,
                                        uint32_t* sleepers, double deadline) {
    int rc, k;
    if (s->hook != NULL && !s->hooked) {
        for (k = 0; k < FERRO_HOOK_SPINS; k++) {
            if (ferro_arrived(ferro_load(word), target, FERRO_UNTIL_REACHED)) return FERRO_OK;
            ferro_pause();
        }
        s->hooked = 1;
        s->hook(s->hook_ctx, 1);
    }
    if (s->stall != NULL && !s->reported && s->soft < deadline) {
        rc = ferro_wait(&s->pol, word, target, FERRO_UNTIL_REACHED, sleepers, s->soft,
                        s->failed, NULL, 0.0);
        if (rc != FERRO_TIMEOUT) return rc;
        s->reported = 1;
        s->stall(s);
    }
    return ferro_wait(&s->pol, word, target, FERRO_UNTIL_REACHED, sleepers, deadline, s->failed,
                      NULL, 0.0);
}

static inline int ferro_slots_wait_all(ferro_slots* s, uint32_t step, double deadline) {
    int j, rc = FERRO_OK;
    ferro_ctrl* c;
    double t0 = s->clock ? ferro_now() : 0.0;
    for (j = 0; j < s->n && rc == FERRO_OK; j++) {
        if (j == s->me) continue;
        c = ferro_ctrl_of(s->base, &s->L, j);
        rc = ferro_slots_wait_word(s, &c->step, step, &c->sleepers, deadline);
    }
    if (s->clock) s->waited += ferro_now() - t0;
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

#endif
