/* The door into the same-host engine: ferro/engine.h's calls, on the steps of _steps.h.
 *
 * A call: check its arguments (FERRO_INVALID before anything is published), take its place in
 * the order (the thread rule), wait for its turn, then run its collective's protocol, each
 * chosen from what every rank's header agrees on (so the ranks always run the same one):
 *
 *   barrier         one step, header only
 *   allreduce       one step (post, meet, fold every slot) up to a slot; split (_split.h) from
 *                   the engine's split threshold, and always beyond a slot
 *   reduce_scatter  one step (each rank folds its part) below FERRO_SPLIT_SCATTER_MIN (256
 *                   KiB) or 4 split thresholds; split from there, and always beyond a slot
 *   all_gather      one step up to a slot per block, streamed (_stream.h) beyond
 *   broadcast       one step per slot of data (a large one: steps pipelined two deep)
 *   reduce, gather  one step per slot of data per rank, the root folding or copying
 *   scatter,        one step per slot of data, each step carrying a piece of every block
 *   all_to_all
 *
 * A step's wait reports a stall once half its timeout has passed (ferro_slots.stall), then
 * waits on. A timeout or a failure breaks the communicator; a mismatch is found at a call's
 * first step on every rank and leaves it whole. No Python anywhere.
 *
 * The link between the ranks' cores is probed again (_probe.h) after a call that rank 0 marked
 * as it began (ask_reprobe): rank 0 writes the next call's ticket in its control line before it
 * publishes the call's first step, so every rank that completes the call has read it (each
 * waited for rank 0's step), and every rank probes as its next call's turn begins, whichever
 * path runs that call (a door call, or ferro's Python steps in a ferro_comm_begin turn).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "_door.h"

static _Thread_local char last_msg[FERRO_MSG];
/* a call moving more than this calls its wait hook before it starts */
#define FERRO_HOOK_BYTES 65536u

static uintptr_t self_thread(void) { return (uintptr_t)pthread_self(); }

int ferro_door_say(int status, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_msg, sizeof last_msg, fmt, ap);
    va_end(ap);
    return status;
}

#define say ferro_door_say

static ferro_comm* comm_of(ferro_slots* s) {
    return (ferro_comm*)(void*)((char*)s - offsetof(ferro_comm, s));
}

/* ------------------------------------------------------------------ the communicator */
static const ferro_engine_api TABLE;
static void api_release(ferro_comm* c);

ferro_comm* ferro_comm_create(int fd, size_t size, int nranks, int rank, size_t slot_bytes,
                              size_t ring_bytes, int spin, int yields, double timeout,
                              char* why, size_t why_len) {
    ferro_comm* c;
    ferro_layout L;
    void* base;
    int flags = MAP_SHARED;
    if (nranks < 1 || rank < 0 || rank >= nranks) {
        snprintf(why, why_len, "rank %d is not one of %d ranks", rank, nranks);
        return NULL;
    }
    ferro_layout_init(&L, nranks, slot_bytes, ring_bytes);
    if (size < L.size) {
        snprintf(why, why_len, "a %zu-byte segment is smaller than its layout (%zu bytes)",
                 size, L.size);
        return NULL;
    }
    if (size <= ((size_t)64 << 20)) flags |= MAP_POPULATE;  /* no page faults inside a call */
    base = mmap(NULL, size, PROT_READ | PROT_WRITE, flags, fd, 0);
    if (base == MAP_FAILED) {
        snprintf(why, why_len, "cannot map the engine segment: %s", strerror(errno));
        return NULL;
    }
    c = (ferro_comm*)calloc(1, sizeof *c);
    if (c != NULL) {
        c->s.split.bases = (uint32_t*)calloc(3 * (size_t)nranks, sizeof(uint32_t));
        c->s.split.scratch = (unsigned char*)calloc(FERRO_SPLIT_CHUNK_MAX + 256, 1);
    }
    if (c == NULL || c->s.split.bases == NULL || c->s.split.scratch == NULL) {
        if (c != NULL) {
            free(c->s.split.bases);
            free(c->s.split.scratch);
            free(c);
        }
        munmap(base, size);
        snprintf(why, why_len, "no memory for a communicator");
        return NULL;
    }
    c->head.magic = FERRO_ENGINE_MAGIC;
    c->head.abi_major = FERRO_ENGINE_ABI_MAJOR;
    c->head.abi_minor = FERRO_ENGINE_ABI_MINOR;
    c->head.api = &TABLE;
    c->refs = 1;
    c->base = (unsigned char*)base;
    c->size = size;
    c->timeout = timeout;
    c->stall_fraction = 0.5;
    pthread_mutex_init(&c->lock, NULL);
    c->s.base = c->base;
    c->s.L = L;
    c->s.n = nranks;
    c->s.me = rank;
    c->s.pol.spin = spin;
    c->s.pol.yields = yields;
    c->s.failed = &c->failed;
    c->s.split.wait_which = -1;
    if (ferro_p2p_init(c) != 0) {
        api_release(c);
        snprintf(why, why_len, "no memory for a communicator");
        return NULL;
    }
    return c;
}

const ferro_engine_api* ferro_engine_table(void) { return &TABLE; }

static int api_rank(const ferro_comm* c) { return c->s.me; }
static int api_world_size(const ferro_comm* c) { return c->s.n; }
static double api_default_timeout(const ferro_comm* c) { return c->timeout; }

static void api_retain(ferro_comm* c) { __atomic_add_fetch(&c->refs, 1u, __ATOMIC_ACQ_REL); }

static void api_release(ferro_comm* c) {
    if (c == NULL || __atomic_sub_fetch(&c->refs, 1u, __ATOMIC_ACQ_REL) != 0) return;
    ferro_p2p_free(c);
    munmap(c->base, c->size);
    pthread_mutex_destroy(&c->lock);
    free(c->skipped);
    free(c->s.split.bases);
    free(c->s.split.scratch);
    free(c);
}

void ferro_comm_mark_failed(ferro_comm* c, const char* reason) {
    int r;
    ferro_ring_ctrl* ring;
    pthread_mutex_lock(&c->lock);
    if (c->failure[0] == '\0' && reason != NULL && reason[0] != '\0')
        snprintf(c->failure, sizeof c->failure, "%s", reason);
    pthread_mutex_unlock(&c->lock);
    ferro_store(&c->failed, 1u);
    for (r = 0; r < c->s.n; r++) {  /* every wait on the segment ends now, not a slice later */
        ferro_ctrl* ctrl = ferro_ctrl_of(c->base, &c->s.L, r);
        ferro_futex_wake(&ctrl->step);
        ferro_futex_wake(&ctrl->inprog);
        ferro_futex_wake(&ctrl->outprog);
        ferro_futex_wake(&ctrl->gprog);
        if (c->s.L.ring_bytes > 0) {  /* Python's messages' rings, and the door's own */
            ring = ferro_ring_of(c->base, &c->s.L, r, c->s.me);
            ferro_futex_wake(&ring->head);
            ring = ferro_ring_of(c->base, &c->s.L, c->s.me, r);
            ferro_futex_wake(&ring->tail);
            ring = ferro_door_ring_of(c->base, &c->s.L, r, c->s.me);
            ferro_futex_wake(&ring->head);
            ring = ferro_door_ring_of(c->base, &c->s.L, c->s.me, r);
            ferro_futex_wake(&ring->tail);
        }
    }
    ferro_add(&c->turn, 1);
    ferro_futex_wake(&c->turn);
}

static int api_close(ferro_comm* c) {
    ferro_store(&c->closed, 1u);
    ferro_comm_mark_failed(c, "the engine was closed");
    return FERRO_OK;
}

/* In a forked child (one thread, the parent's other threads gone): closed, for this process
 * only. Nothing is written to the segment and nobody is woken (the peers' and the parent's
 * waits are theirs), and the lock a parent thread may have held at the fork is made anew. */
void ferro_comm_forked(ferro_comm* c) {
    pthread_mutex_init(&c->lock, NULL);
    __atomic_store_n(&c->running_thread, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&c->now_thread, 0, __ATOMIC_RELAXED);
    ferro_store(&c->closed, 1u);
    ferro_store(&c->failed, 1u);
}

void ferro_comm_break(ferro_comm* c, int status, const char* message) {
    pthread_mutex_lock(&c->lock);
    if (!c->broken) {
        c->broken = status;
        snprintf(c->broken_msg, sizeof c->broken_msg, "%s", message);
    }
    pthread_mutex_unlock(&c->lock);
    ferro_add(&c->turn, 1);
    ferro_futex_wake(&c->turn);
}

static void api_set_stall_report(ferro_comm* c, ferro_stall_fn fn, void* ctx) {
    pthread_mutex_lock(&c->lock);
    c->stall = fn;
    c->stall_ctx = ctx;
    pthread_mutex_unlock(&c->lock);
}

int ferro_comm_missing(ferro_comm* c, int* out) {
    int j, k = 0, which = c->s.split.wait_which;
    ferro_ctrl* ctrl;
    uint32_t word, target;
    for (j = 0; j < c->s.n; j++)
        if (j != c->s.me && (int32_t)(ferro_load(&ferro_ctrl_of(c->base, &c->s.L, j)->step)
                                      - c->s.step) < 0)
            out[k++] = j;
    if (k > 0 || which < 0 || c->s.split.bases == NULL) return k;
    /* every rank reached the step: inside a pipelined one (_split.h, _stream.h), the ranks
     * whose progress word is behind the chunk this rank waits for */
    for (j = 0; j < c->s.n; j++) {
        if (j == c->s.me) continue;
        ctrl = ferro_ctrl_of(c->base, &c->s.L, j);
        word = ferro_load(which == FERRO_PROG_IN ? &ctrl->inprog
                          : which == FERRO_PROG_OUT ? &ctrl->outprog : &ctrl->gprog);
        target = c->s.split.bases[3 * j + which] + (uint32_t)c->s.split.wait_k + 1u;
        if ((int32_t)(word - target) < 0) out[k++] = j;
    }
    return k;
}

/* "[1, 3]" of the ranks not at this rank's step, or behind the pipelined chunk it waits for */
static void missing_text(ferro_comm* c, char* out, size_t len) {
    int few[64], *ranks = few, k, j;
    size_t at;
    if (c->s.n > 64) ranks = (int*)malloc((size_t)c->s.n * sizeof(int));
    if (ranks == NULL) {
        snprintf(out, len, "[?]");
        return;
    }
    k = ferro_comm_missing(c, ranks);
    at = (size_t)snprintf(out, len, "[");
    for (j = 0; j < k && at < len; j++)
        at += (size_t)snprintf(out + at, len - at, "%s%d", j ? ", " : "", ranks[j]);
    if (at < len) snprintf(out + at, len - at, "]");
    if (ranks != few) free(ranks);
}

/* ------------------------------------------------------------------ the order of calls */
static void give_back(ferro_comm* c, int64_t ticket);

static int64_t api_reserve(ferro_comm* c) {
    return __atomic_fetch_add(&c->next_ticket, 1, __ATOMIC_ACQ_REL);
}

/* serving's turn is over (lock held): on to the next ticket not given back */
static void advance(ferro_comm* c) {
    size_t k = 0;
    c->serving++;
    while (k < c->nskipped && c->skipped[k] == c->serving) {
        k++;
        c->serving++;
    }
    if (k > 0) {
        memmove(c->skipped, c->skipped + k, (c->nskipped - k) * sizeof(int64_t));
        c->nskipped -= k;
    }
    ferro_add(&c->turn, 1);
}

/* remember that ticket (ahead of serving) was given back (lock held); 0, or -1: no memory */
static int remember_skip(ferro_comm* c, int64_t ticket) {
    size_t k = c->nskipped;
    int64_t* grown;
    if (c->nskipped == c->skip_room) {
        c->skip_room = c->skip_room ? 2 * c->skip_room : 16;
        grown = (int64_t*)realloc(c->skipped, c->skip_room * sizeof(int64_t));
        if (grown == NULL) return -1;
        c->skipped = grown;
    }
    while (k > 0 && c->skipped[k - 1] > ticket) {  /* kept in order */
        c->skipped[k] = c->skipped[k - 1];
        k--;
    }
    if (k > 0 && c->skipped[k - 1] == ticket) {  /* given back twice: once is enough */
        memmove(c->skipped + k, c->skipped + k + 1, (c->nskipped - k) * sizeof(int64_t));
        return 0;
    }
    c->skipped[k] = ticket;
    c->nskipped++;
    return 0;
}

static void wake_turn(ferro_comm* c) {
    if (ferro_load(&c->turn_sleepers) != 0) ferro_futex_wake(&c->turn);
}

static int api_skip(ferro_comm* c, int64_t ticket) {
    int rc = FERRO_OK;
    pthread_mutex_lock(&c->lock);
    if (ticket < 0 || ticket >= __atomic_load_n(&c->next_ticket, __ATOMIC_ACQUIRE))
        rc = say(FERRO_INVALID, "skip: ticket %lld was never reserved", (long long)ticket);
    else if (ticket == c->serving)
        advance(c);
    else if (ticket > c->serving && remember_skip(c, ticket) != 0)
        rc = say(FERRO_NOMEM, "skip: no memory to remember ticket %lld", (long long)ticket);
    pthread_mutex_unlock(&c->lock);
    wake_turn(c);
    return rc;
}

/* Ticket's call (serving, lock held) took fewer tickets than a peer's call at the same place
 * (count more: a header's span): give the next count back unrun, if no other call reserved
 * one after it. 1: given back; 0: calls were reserved after it (they keep their tickets); -1:
 * no memory. */
static int catch_up_locked(ferro_comm* c, int64_t ticket, int64_t count) {
    int64_t after = ticket + 1, t;
    size_t room = c->skip_room;
    int64_t* grown;
    if (count <= 0) return 1;
    while (room < c->nskipped + (size_t)count) room = room ? 2 * room : 16;
    if (room != c->skip_room) {  /* (room first: a ticket taken and not remembered would hang) */
        grown = (int64_t*)realloc(c->skipped, room * sizeof(int64_t));
        if (grown == NULL) return -1;
        c->skipped = grown;
        c->skip_room = room;
    }
    if (!__atomic_compare_exchange_n(&c->next_ticket, &after, ticket + 1 + count, 0,
                                     __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return 0;
    for (t = ticket + 1; t <= ticket + count; t++)
        remember_skip(c, t);  /* (the room is there) */
    return 1;
}

int ferro_comm_catch_up(ferro_comm* c, int64_t ticket, int64_t count) {
    int rc;
    pthread_mutex_lock(&c->lock);
    rc = c->serving == ticket ? catch_up_locked(c, ticket, count) : 0;
    pthread_mutex_unlock(&c->lock);
    return rc;
}

/* After a mismatch: the tickets this call (header mine) owes to catch up with the peer whose
 * call took the most (the headers' spans), 0 if none. */
static int64_t owed(ferro_slots* s, const unsigned char* mine) {
    int64_t most = ferro_header_span(mine), span;
    int j;
    for (j = 0; j < s->n; j++) {
        span = ferro_header_span(ferro_slots_slot(s, j, s->step)->header);
        if (span > most) most = span;
    }
    return most - ferro_header_span(mine);
}

void ferro_comm_end(ferro_comm* c, int64_t ticket) {
    pthread_mutex_lock(&c->lock);
    if (c->running_thread == self_thread()) c->running_thread = 0;
    pthread_mutex_unlock(&c->lock);
    give_back(c, ticket);  /* its turn is over, or will be skipped when it comes */
}

/* (a call's wait hook, once, before it waits or moves much) */
static void hook_on(ferro_wait_hook hook, void* ctx, int* hooked) {
    if (hook != NULL && !*hooked) {
        *hooked = 1;
        hook(ctx, 1);
    }
}

/* Wait until ticket's turn (deadline: a monotonic time), or the communicator closes or breaks;
 * a wait beyond the spin calls the hook first (when there is one: *hooked then). */
static int wait_turn(ferro_comm* c, int64_t ticket, double deadline, const char* name,
                     ferro_wait_hook hook, void* hook_ctx, int* hooked) {
    int64_t serving;
    uint32_t seen;
    int spins = 0;
    double now, slice;
    for (;;) {
        seen = ferro_load(&c->turn);
        serving = __atomic_load_n(&c->serving, __ATOMIC_ACQUIRE);
        if (serving == ticket) return FERRO_OK;
        if (ferro_load(&c->closed))
            return say(FERRO_CLOSED, "%s on rank %d: the engine is closed", name, c->s.me);
        if (c->broken) return say(c->broken, "%s", c->broken_msg);
        if (serving > ticket)
            return say(FERRO_INVALID, "%s: ticket %lld was already used (the call running is "
                       "%lld)", name, (long long)ticket, (long long)serving);
        if (spins < 200) {
            spins++;
            ferro_pause();
            continue;
        }
        hook_on(hook, hook_ctx, hooked);
        now = ferro_now();
        if (now >= deadline)
            return say(FERRO_TIMEOUT, "%s (seq %lld) on rank %d: timed out waiting for earlier "
                       "collectives on this backend", name, (long long)ticket, c->s.me);
        slice = deadline - now;
        ferro_add(&c->turn_sleepers, 1);
        if (__atomic_load_n(&c->serving, __ATOMIC_ACQUIRE) != ticket)
            ferro_futex_wait(&c->turn, seen, slice < FERRO_SLICE ? slice : FERRO_SLICE);
        ferro_add(&c->turn_sleepers, -1);
    }
}

static int probe_if_asked(ferro_comm* c, int64_t ticket, double timeout);

/* A wait of ticket's call (name) ended on the failure flag: this thread's message, and the
 * communicator broken (FERRO_FAILED), or FERRO_CLOSED where this rank closed it. */
static int failed(ferro_comm* c, const char* name, int64_t ticket) {
    char msg[FERRO_MSG];
    if (ferro_load(&c->closed))
        return say(FERRO_CLOSED, "%s (seq %lld) on rank %d: the engine was closed", name,
                   (long long)ticket, c->s.me);
    pthread_mutex_lock(&c->lock);
    snprintf(msg, sizeof msg, "%s (seq %lld) on rank %d: %.900s", name, (long long)ticket,
             c->s.me, c->failure[0] ? c->failure : "the engine was shut down");
    pthread_mutex_unlock(&c->lock);
    say(FERRO_FAILED, "%s", msg);
    ferro_comm_break(c, FERRO_FAILED, msg);
    return FERRO_FAILED;
}

/* A probe before ticket's call (name) failed with rc: this thread's message, and the
 * communicator broken as a step's timeout or failure leaves it; the call's status. */
static int probe_failed(ferro_comm* c, const char* name, int64_t ticket, int rc,
                        double timeout) {
    char msg[FERRO_MSG];
    if (rc != FERRO_TIMEOUT) return failed(c, name, ticket);
    snprintf(msg, sizeof msg, "%s (seq %lld) on rank %d: timed out after %gs in the link probe "
             "every rank runs before it (a rank did not take part; shared-memory engine)", name,
             (long long)ticket, c->s.me, timeout > 0 ? timeout : c->timeout);
    say(FERRO_TIMEOUT, "%s", msg);
    ferro_comm_break(c, FERRO_TIMEOUT, msg);
    return FERRO_TIMEOUT;
}

int ferro_comm_begin(ferro_comm* c, int64_t ticket, double timeout, const char* name) {
    int rc;
    double start = ferro_now_late();
    if (c->running_thread == self_thread())
        return say(FERRO_BUSY, "%s: called from inside another call on this communicator", name);
    rc = wait_turn(c, ticket, timeout < 0 ? start : start + timeout, name, NULL, NULL, NULL);
    if (rc == FERRO_OK) {
        pthread_mutex_lock(&c->lock);
        c->s.split.wait_which = -1;
        c->running_thread = self_thread();
        pthread_mutex_unlock(&c->lock);
        rc = probe_if_asked(c, ticket, timeout);
        if (rc != FERRO_OK) rc = probe_failed(c, name, ticket, rc, timeout);
    }
    return rc;
}

/* ------------------------------------------------------------------ one call */
typedef struct {
    ferro_comm* c;
    const char* name;
    int64_t ticket;
    int unreserved;
    ferro_wait_hook hook;    /* the caller's wait hook (NULL: none), and whether it was called */
    void* hook_ctx;
    int hooked;
    int probed;              /* the link probe before the call failed (its message said) */
    double start, timeout, hard;
    unsigned char header[FERRO_HEADER_BYTES];
    uint64_t hash;
} door_call;

/* the stall report of the call under way (ferro_slots.stall) */
static void report_stall(ferro_slots* s) {
    ferro_comm* c = comm_of(s);
    char missing[256], msg[FERRO_MSG];
    if (c->stall == NULL) return;
    missing_text(c, missing, sizeof missing);
    snprintf(msg, sizeof msg, "%s (seq %lld) on rank %d: still waiting for ranks %s after "
             "%.1fs (shared-memory engine, step %u)", c->call_name, (long long)c->call_seq,
             c->s.me, missing, ferro_now() - c->call_start, c->s.step);
    c->stall(c->stall_ctx, msg);
}

int ferro_door_check_opts(const ferro_opts* o, const char* name, double* timeout) {
    if (o == NULL) return FERRO_OK;
    if (o->size < sizeof(ferro_opts))
        return say(FERRO_INVALID, "%s: opts of %u bytes (fill them with FERRO_OPTS_INIT)", name,
                   o->size);
    if (isnan(o->timeout) || o->timeout < 0)
        return say(FERRO_INVALID, "%s: timeout %g is not a number of seconds >= 0", name,
                   o->timeout);
    if (o->timeout > 0) *timeout = o->timeout;
    if (o->ticket < FERRO_TICKET_NOW)
        return say(FERRO_INVALID, "%s: ticket %lld is neither FERRO_TICKET_NOW nor reserved",
                   name, (long long)o->ticket);
    if ((o->flags >> 24) > 8)
        return say(FERRO_INVALID, "%s: opts flags 0x%x: FERRO_OPTS_OP(%u) is no op's wire code "
                   "(1-8)", name, o->flags, o->flags >> 24);
    if (o->ndim < 0 || (o->ndim > 0 && o->dims == NULL))
        return say(FERRO_INVALID, "%s: a shape of %d dims at %p", name, o->ndim,
                   (const void*)o->dims);
    return FERRO_OK;
}

/* give ticket back unrun, keeping this thread's message */
static void give_back(ferro_comm* c, int64_t ticket) {
    char keep[FERRO_MSG];
    memcpy(keep, last_msg, sizeof keep);
    api_skip(c, ticket);
    memcpy(last_msg, keep, sizeof keep);
}

/* ------------------------------------------------------------------ re-probes of the link */
/* Rank 0, as a call begins (before its first step is published): every 8th call, ask every
 * rank to probe the link again after this call when reprobe_s seconds have passed since the
 * segment's last probe, or FERRO_REPROBE_MIN_S have and this rank's plain copies into shared
 * memory (ferro_put) run at another speed than they did then (FERRO_REPROBE_FACTOR either
 * way): the calls slowed down or sped up, so the ranks' cores may stand elsewhere now. */
static void ask_reprobe(ferro_comm* c, int64_t ticket) {
    const ferro_seg_head* head = ferro_head_of(c->base);
    double since, put = c->s.put.ewma_ns, ref = c->probe_put_ns;
    if ((++c->probe_looks & 7u) != 0) return;
    since = ferro_wall_now() - head->link_at;
    if (ref <= 0) c->probe_put_ns = ref = put;
    if (since >= c->reprobe_s
            || (since >= FERRO_REPROBE_MIN_S && put > 0 && ref > 0
                && (put > ref * FERRO_REPROBE_FACTOR || put * FERRO_REPROBE_FACTOR < ref)))
        __atomic_store_n(&ferro_ctrl_of(c->base, &c->s.L, 0)->reprobe, ticket + 2,
                         __ATOMIC_RELAXED);  /* (the next ticket + 1; the step's publication
                                              * releases it) */
}

/* As ticket's turn begins on this rank (its call not begun): the probe rank 0 asked for
 * after the call before, run once per ticket (a door call inside a ferro_comm_begin turn
 * passes here twice), with its own timeout from now. FERRO_OK (also when none was asked), or
 * FERRO_TIMEOUT / FERRO_FAILED as _probe.h says. */
static int probe_if_asked(ferro_comm* c, int64_t ticket, double timeout) {
    size_t bytes;
    double rtt, gbps;
    int rc;
    if (__atomic_load_n(&ferro_ctrl_of(c->base, &c->s.L, 0)->reprobe, __ATOMIC_ACQUIRE)
            != ticket + 1 || c->probed_before == ticket + 1)
        return FERRO_OK;
    c->probed_before = ticket + 1;
    bytes = FERRO_PROBE_BYTES < c->s.L.slot_bytes ? FERRO_PROBE_BYTES : c->s.L.slot_bytes;
    rc = ferro_probe_links(c->base, &c->s.L, c->s.me, FERRO_PROBE_ROUNDS,
                           FERRO_PROBE_COPIES, bytes, c->s.split.scratch,
                           ferro_now() + (timeout > 0 ? timeout : c->timeout), &c->failed,
                           &rtt, &gbps);
    if (rc == FERRO_OK) c->probe_put_ns = c->s.put.ewma_ns;
    return rc;
}

/* A call refused before it began: its reserved ticket is given back (a call consumes its
 * ticket whatever it returns), the message kept. */
static int refuse(ferro_comm* c, const ferro_opts* o, int status) {
    if (o != NULL && o->ticket >= 0) give_back(c, o->ticket);
    return status;
}

static int finish(door_call* k, int rc);

/* The start of a call whose arguments are checked: its header (coll, dtype, shape: opts' or
 * [count], op, root), its ticket and its turn. */
static int begin(door_call* k, ferro_comm* c, const char* name, int coll, const ferro_opts* o,
                 double timeout, int dtype, size_t count, int op, int root, size_t nbytes) {
    int64_t dims1 = (int64_t)count, ticket;
    int ndim = dtype < 0 ? 0 : 1, rc;
    const int64_t* dims = &dims1;
    uintptr_t me = self_thread(), expected = 0;
    k->c = c;
    k->name = name;
    k->timeout = timeout;
    k->unreserved = 0;
    k->hook = o != NULL ? o->wait_hook : NULL;
    k->hook_ctx = o != NULL ? o->wait_ctx : NULL;
    k->hooked = 0;
    k->probed = 0;
    k->start = ferro_now_late();  /* (the deadline: never early, at most two ticks late) */
    k->hard = k->start + timeout;
    if (ferro_load(&c->closed))
        return refuse(c, o, say(FERRO_CLOSED, "%s on rank %d: the engine is closed", name,
                                c->s.me));
    if (c->broken) return refuse(c, o, say(c->broken, "%s", c->broken_msg));
    if (__atomic_load_n(&c->running_thread, __ATOMIC_RELAXED) == me
            && (o == NULL || o->ticket != __atomic_load_n(&c->serving, __ATOMIC_ACQUIRE)))
        /* (a call on the ticket whose turn this thread began with ferro_comm_begin runs in it) */
        return refuse(c, o, say(FERRO_BUSY, "%s on rank %d: called from inside another call on "
                                "this communicator (the thread rule, ferro/engine.h)", name,
                                c->s.me));
    if (o == NULL || o->ticket == FERRO_TICKET_NOW) {
        if (!__atomic_compare_exchange_n(&c->now_thread, &expected, me, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE) && expected != me)
            return say(FERRO_BUSY, "%s on rank %d: another thread is in an unreserved call (%s) "
                       "on this communicator; calls from several threads at once must reserve "
                       "their tickets in the same order on every rank (the thread rule, "
                       "ferro/engine.h)", name, c->s.me, c->now_name ? c->now_name : "?");
        c->now_name = name;
        k->unreserved = 1;
        k->ticket = api_reserve(c);
    } else {
        k->ticket = o->ticket;
        if (k->ticket >= __atomic_load_n(&c->next_ticket, __ATOMIC_ACQUIRE))
            return say(FERRO_INVALID, "%s: ticket %lld was never reserved", name,
                       (long long)k->ticket);
    }
    ticket = k->ticket;
    rc = wait_turn(c, ticket, k->hard, name, k->hook, k->hook_ctx, &k->hooked);
    if (rc != FERRO_OK) {
        if (k->unreserved) __atomic_store_n(&c->now_thread, 0, __ATOMIC_RELEASE);
        if (rc != FERRO_INVALID) give_back(c, ticket);  /* the calls behind it go on */
        if (k->hooked) k->hook(k->hook_ctx, 0);
        return rc;
    }
    __atomic_store_n(&c->running_thread, me, __ATOMIC_RELAXED);
    /* the header (its hash kept for the next call of the same signature: the turn is ours) */
    if (o != NULL && o->dims != NULL && dtype >= 0) {
        ndim = o->ndim;
        dims = o->dims;
    }
    ferro_header_encode(k->header, coll, dtype, o != NULL ? o->type_name : NULL, ndim, dims, op,
                        root, 0, 0, o != NULL ? FERRO_OPTS_SPAN(o->flags) : 0u);
    if (o != NULL && (o->flags >> 16 & 0xFFu) != 0)  /* the client's call, named (its stage) */
        k->header[2] = (unsigned char)(o->flags >> 16 & 0xFFu);
    if (o != NULL && (o->flags >> 24) != 0)
        k->header[3] = (unsigned char)(o->flags >> 24);
    if (memcmp(k->header, c->last_header, FERRO_HEADER_BYTES) != 0) {
        memcpy(c->last_header, k->header, FERRO_HEADER_BYTES);
        c->last_hash = ferro_header_hash(k->header, FERRO_HEADER_BYTES);
    }
    k->hash = c->last_hash;
    c->call_name = name;
    c->call_seq = ticket;
    c->call_start = k->start;
    c->call_timeout = timeout;
    c->s.stall = c->stall != NULL ? report_stall : NULL;
    c->s.soft = k->start + timeout * c->stall_fraction;
    c->s.reported = 0;
    c->s.split.wait_which = -1;
    c->s.hook = k->hook;
    c->s.hook_ctx = k->hook_ctx;
    c->s.hooked = k->hooked;
    if (nbytes > FERRO_HOOK_BYTES) {  /* a long copy or fold: the hook now */
        hook_on(k->hook, k->hook_ctx, &k->hooked);
        c->s.hooked = k->hooked;
    }
    if (ferro_load(&c->failed))
        /* a peer died, closed or aborted before this call began: what it left in the slots may
         * be a call it gave up on (its deadline passed), which a late rank would otherwise
         * complete with it; the call fails, as its waits would */
        return finish(k, FERRO_FAILED);
    if ((rc = probe_if_asked(c, ticket, timeout)) != FERRO_OK) {
        k->probed = 1;
        return finish(k, probe_failed(c, name, ticket, rc, timeout));  /* (the turn goes on) */
    }
    if (c->s.me == 0 && c->reprobe_s > 0) ask_reprobe(c, ticket);
    return FERRO_OK;
}

/* The end of a call that had its turn: its steps' status as the call's (with its message; a
 * timeout or a failure breaks the communicator), and the turn to the next ticket. */
static int finish(door_call* k, int rc) {
    ferro_comm* c = k->c;
    char missing[256], other[128], msg[FERRO_MSG];
    int j, g, at;
    int64_t behind = 0;
    size_t len;
    c->s.stall = NULL;
    k->hooked = c->s.hooked;  /* (the steps' state is the next call's once the turn is given) */
    c->s.hook = NULL;
    c->s.hooked = 0;
    if (rc == FERRO_MISMATCH) {
        /* every distinct header with the ranks that published it, in rank order */
        const unsigned char* h[64];
        int n = c->s.n < 64 ? c->s.n : 64, seen[64];
        len = (size_t)snprintf(msg, sizeof msg, "%s: ranks disagree on the collective: ",
                               k->name);
        for (j = 0; j < n; j++) {
            h[j] = ferro_slots_slot(&c->s, j, c->s.step)->header;
            seen[j] = 0;
        }
        for (j = 0; j < n && !(h[j][5] & FERRO_HEADER_INVALID); j++) {}
        if (j < n && !(h[c->s.me][5] & FERRO_HEADER_INVALID)) {
            /* a rank refused the call (its arguments were wrong): its reason first */
            ferro_header_reason(h[j], other, sizeof other);
            len = (size_t)snprintf(msg, sizeof msg, "%s (seq %lld): rank %d refused the call "
                                   "(%s)", k->name, (long long)k->ticket, j, other);
            for (g = j + 1; g < n && len < sizeof msg; g++) {
                if (!(h[g][5] & FERRO_HEADER_INVALID)) continue;
                ferro_header_reason(h[g], other, sizeof other);
                len += (size_t)snprintf(msg + len, sizeof msg - len, "; rank %d refused it (%s)",
                                        g, other);
            }
            if (len < sizeof msg)
                snprintf(msg + len, sizeof msg - len, "; every rank raises, none waits for it");
            n = 0;  /* (described) */
        }
        for (j = 0; j < n && len < sizeof msg; j++) {
            if (seen[j]) continue;
            ferro_header_describe(h[j], FERRO_HEADER_BYTES, other, sizeof other);
            len += (size_t)snprintf(msg + len, sizeof msg - len, "%sranks [", j ? "; " : "");
            for (g = j, at = 0; g < n && len < sizeof msg; g++) {
                if (seen[g] || memcmp(h[g], h[j], FERRO_HEADER_BYTES) != 0) continue;
                seen[g] = 1;
                len += (size_t)snprintf(msg + len, sizeof msg - len, "%s%d", at++ ? ", " : "", g);
            }
            if (len < sizeof msg)
                len += (size_t)snprintf(msg + len, sizeof msg - len, "] called %s", other);
        }
        say(FERRO_MISMATCH, "%s", msg);
        behind = owed(&c->s, k->header);
    } else if (k->probed) {
        /* (probe_failed said why and broke the communicator or found it closed) */
    } else if (rc == FERRO_TIMEOUT) {
        missing_text(c, missing, sizeof missing);
        if (strcmp(missing, "[]") == 0)
            snprintf(msg, sizeof msg, "%s (seq %lld) on rank %d: timed out after %gs waiting "
                     "for the peers' chunks of a pipelined step (shared-memory engine)",
                     k->name, (long long)k->ticket, c->s.me, k->timeout);
        else
            snprintf(msg, sizeof msg, "%s (seq %lld) on rank %d: timed out after %gs waiting "
                     "for ranks %s (shared-memory engine)", k->name, (long long)k->ticket,
                     c->s.me, k->timeout, missing);
        say(FERRO_TIMEOUT, "%s", msg);
        ferro_comm_break(c, FERRO_TIMEOUT, msg);
    } else if (rc == FERRO_FAILED) {
        rc = failed(c, k->name, k->ticket);
    } else if (rc != FERRO_OK) {
        rc = say(FERRO_UNSUPPORTED, "%s: the engine's fold cannot reduce this dtype with this op",
                 k->name);
    }
    __atomic_store_n(&c->running_thread, 0, __ATOMIC_RELAXED);
    if (k->unreserved) __atomic_store_n(&c->now_thread, 0, __ATOMIC_RELEASE);
    pthread_mutex_lock(&c->lock);
    if (c->serving == k->ticket) {
        if (behind > 0) catch_up_locked(c, k->ticket, behind);  /* (else: as the peers say) */
        advance(c);
    }
    pthread_mutex_unlock(&c->lock);
    wake_turn(c);
    if (k->hooked) k->hook(k->hook_ctx, 0);
    return rc;
}

/* ------------------------------------------------------------------ steps of a call */
static uint32_t seq_of(const door_call* k) { return (uint32_t)k->ticket; }

/* post `nbytes` of src (span: the call's bytes per rank in the slot), then meet */
static int step(door_call* k, const void* src, size_t nbytes, size_t span) {
    ferro_slots* s = &k->c->s;
    ferro_slots_post(s, k->header, FERRO_HEADER_BYTES, 1, k->hash, seq_of(k),
                     (const unsigned char*)src, nbytes, span);
    return ferro_slots_meet(s, k->hard);
}

/* this rank's slot data of the next step, for a call that writes it in parts */
static unsigned char* next_place(ferro_slots* s, size_t span) {
    return ferro_slot_data(ferro_slots_slot(s, s->me, s->step + 1))
        + ferro_slots_rot(s, s->step + 1, span);
}

static unsigned char* peer_data(ferro_slots* s, int rank) {
    return ferro_slot_data(ferro_slots_slot(s, rank, s->step)) + s->rot;
}

/* a step whose fold of count items at offset of every slot goes to out (NULL: none here) */
static int fold_step(door_call* k, const void* src, size_t nbytes, void* out, size_t offset,
                     size_t count, int dtype, int op) {
    ferro_slots* s = &k->c->s;
    int rc = step(k, src, nbytes, nbytes);
    if (rc == FERRO_OK && out != NULL && count > 0
            && ferro_slots_fold(s, out, offset, (ptrdiff_t)count, dtype, op,
                                op == FERRO_AVG ? (double)s->n : 0.0) != 0)
        rc = -1;
    return rc;
}

/* a step of a broadcast (root >= 0: out = root's nbytes; only root posts) or of an
 * all_gather / gather (root = -1: block r of out from rank r; out NULL: nothing copied) */
static int copy_step(door_call* k, const void* src, size_t nbytes, void* out, int root) {
    ferro_slots* s = &k->c->s;
    int rc;
    ferro_slots_post(s, k->header, FERRO_HEADER_BYTES, 1, k->hash, seq_of(k),
                     (const unsigned char*)src, root < 0 || root == s->me ? nbytes : 0, nbytes);
    if (out != NULL) ferro_slots_copy_own(s, out, src, nbytes, root);  /* while peers arrive */
    rc = ferro_slots_meet(s, k->hard);
    if (rc == FERRO_OK && out != NULL) ferro_slots_copy_peers(s, out, nbytes, root);
    return rc;
}

/* the largest multiple of `item` bytes in a slot */
static size_t slot_items(const ferro_slots* s, size_t item) {
    return s->L.slot_bytes / item * item;
}

/* A broadcast of more than half a slot and at most this many bytes moves in equal steps (to
 * the item) of at most half a slot: the root fills one slot while the others copy the other
 * out, and a step's data stays in the cores' caches. 2 processes on this project's 2-core VM, us,
 * median of 3 launches, whole slots -> half slots: cores apart 1 MiB 20.7 -> 18.3 (Intel MPI
 * 17.9), 2 MiB 47.9 -> 39.0, 4 MiB 98 -> 79, 8 MiB 205 -> 158, 10 MiB 241 -> 198; but 12 MiB
 * 366 -> 612 and 16 MiB 562 -> 908 (in the far state, 16 MiB 605 -> 551: every size gains
 * there); 4 processes, 1 MiB 51.7 -> 47.4, 4 MiB 212 -> 186. Up to half a slot one step is the
 * fastest (384 KiB: 6.1 us in one step, 8.1 in two). */
#define FERRO_BROADCAST_HALVES_MAX (8u << 20)

/* the bytes of each of a broadcast's steps (the last may be shorter), a multiple of `item` */
static size_t broadcast_chunk(const ferro_slots* s, size_t nbytes, size_t item) {
    size_t slot = slot_items(s, item), half = slot / 2u / item * item, pieces;
    if (nbytes <= half || nbytes > FERRO_BROADCAST_HALVES_MAX || half == 0) return slot;
    pieces = (nbytes + half - 1u) / half;
    return (nbytes / item + pieces - 1u) / pieces * item;
}

/* ------------------------------------------------------------------ the collectives */
static const char* const OP_NAMES[FERRO_OP_COUNT] = {"SUM", "PROD", "MAX", "MIN", "BAND", "BOR",
                                                     "BXOR", "AVG"};

static int check_dtype(const char* name, int dtype) {
    if (ferro_dtype_size(dtype) == 0)
        return say(FERRO_INVALID, "%s: dtype %d is not one of ferro/engine.h's", name, dtype);
    return FERRO_OK;
}

static int check_op(const char* name, int dtype, int op) {
    int rc = check_dtype(name, dtype);
    if (rc != FERRO_OK) return rc;
    if (op < 0 || op >= FERRO_OP_COUNT)
        return say(FERRO_INVALID, "%s: op %d is not one of ferro/engine.h's", name, op);
    if (!ferro_op_fits(dtype, op))
        return say(FERRO_INVALID, "%s: %s does not reduce %s (AVG: floats; BAND, BOR, BXOR: "
                   "integers and bool; bool: only those)", name, OP_NAMES[op],
                   FERRO_DTYPE_NAMES[dtype]);
    return FERRO_OK;
}

static int check_root(ferro_comm* c, const char* name, int root) {
    if (root < 0 || root >= c->s.n)
        return say(FERRO_INVALID, "%s: root %d is not a rank of %d", name, root, c->s.n);
    return FERRO_OK;
}

static int check_buf(const char* name, const char* which, const void* p, size_t nbytes) {
    if (p == NULL && nbytes > 0)
        return say(FERRO_INVALID, "%s: %s is NULL for %zu bytes", name, which, nbytes);
    return FERRO_OK;
}

/* whether a and b (na, nb bytes) overlap */
static int overlap(const void* a, size_t na, const void* b, size_t nb) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return na != 0 && nb != 0 && x < y + nb && y < x + na;
}

/* whether a and b overlap other than with a exactly `at` bytes into b (an in-place call) */
static int overlaps(const void* a, size_t na, const void* b, size_t nb, size_t at) {
    if ((uintptr_t)a == (uintptr_t)b + at) return 0;
    return overlap(a, na, b, nb);
}

static int check_count(const char* name, size_t count, size_t item, size_t times) {
    if (item != 0 && count > (SIZE_MAX / 4) / item / (times ? times : 1))
        return say(FERRO_INVALID, "%s: %zu items are too many", name, count);
    return FERRO_OK;
}

/* A rooted call's own checks (gather, scatter): `own` is this rank's block of `count` items
 * (gather's send, scatter's recv), `all` the root's blocks of every rank (gather's recv,
 * scatter's send), which may hold `own` only at this rank's block. */
static int check_rooted(ferro_comm* c, const char* name, int dtype, int root, size_t count,
                        const char* own_name, const void* own, const char* all_name,
                        const void* all) {
    size_t n = (size_t)c->s.n, item = ferro_dtype_size(dtype), block;
    int rc;
    if ((rc = check_dtype(name, dtype)) != FERRO_OK) return rc;
    if ((rc = check_root(c, name, root)) != FERRO_OK) return rc;
    if ((rc = check_count(name, count, item, n)) != FERRO_OK) return rc;
    block = count * item;
    if ((rc = check_buf(name, own_name, own, block)) != FERRO_OK) return rc;
    if (root != c->s.me) return FERRO_OK;
    if ((rc = check_buf(name, all_name, all, block * n)) != FERRO_OK) return rc;
    if (overlaps(own, block, all, block * n, block * (size_t)c->s.me))
        return say(FERRO_INVALID, "%s: %s overlaps %s other than at this rank's block", name,
                   own_name, all_name);
    return FERRO_OK;
}

#define CHECK(expr)                                                                          \
    do {                                                                                     \
        int rc_ = (expr);                                                                    \
        if (rc_ != FERRO_OK) return refuse(c, o, rc_);                                       \
    } while (0)

static int api_barrier(ferro_comm* c, const ferro_opts* o) {
    door_call k;
    double timeout = c->timeout;
    int rc;
    CHECK(ferro_door_check_opts(o, "barrier", &timeout));
    rc = begin(&k, c, "barrier", FERRO_COLL_BARRIER, o, timeout, -1, 0, -1, -1, 0);
    if (rc != FERRO_OK) return rc;
    return finish(&k, step(&k, NULL, 0, 0));
}

static int api_allreduce(ferro_comm* c, const void* send, void* recv, size_t count, int dtype,
                         int op, const ferro_opts* o) {
    door_call k;
    double timeout = c->timeout;
    size_t item = ferro_dtype_size(dtype), nbytes;
    int rc;
    ferro_slots* s = &c->s;
    CHECK(ferro_door_check_opts(o, "allreduce", &timeout));
    CHECK(check_op("allreduce", dtype, op));
    CHECK(check_count("allreduce", count, item, 1));
    nbytes = count * item;
    CHECK(check_buf("allreduce", "send", send, nbytes));
    CHECK(check_buf("allreduce", "recv", recv, nbytes));
    if (overlaps(send, nbytes, recv, nbytes, 0))
        CHECK(say(FERRO_INVALID, "allreduce: send and recv overlap without being the same"));
    if (nbytes > s->L.slot_bytes && count > 0 && !ferro_split_can(s, nbytes, (ptrdiff_t)count))
        CHECK(say(FERRO_UNSUPPORTED, "allreduce: %zu items cannot be split on %d ranks with "
                  "%zu-byte slots", count, s->n, s->L.slot_bytes));
    rc = begin(&k, c, "allreduce", FERRO_COLL_ALLREDUCE, o, timeout, dtype, count, op, -1,
               nbytes);
    if (rc != FERRO_OK) return rc;
    if (count > 0 && (ferro_split_fits(s, nbytes, (ptrdiff_t)count) || nbytes > s->L.slot_bytes))
        rc = ferro_split_start(s, k.header, FERRO_HEADER_BYTES, k.hash, seq_of(&k), send, nbytes,
                               recv, (ptrdiff_t)count, dtype, op,
                               op == FERRO_AVG ? (double)s->n : 0.0, 1, k.hard);
    else
        rc = fold_step(&k, send, nbytes, recv, 0, count, dtype, op);
    return finish(&k, rc);
}

static int api_reduce_scatter(ferro_comm* c, const void* send, void* recv, size_t recv_count,
                              int dtype, int op, const ferro_opts* o) {
    door_call k;
    double timeout = c->timeout;
    size_t item = ferro_dtype_size(dtype), part, nbytes, count;
    int rc;
    ferro_slots* s = &c->s;
    CHECK(ferro_door_check_opts(o, "reduce_scatter", &timeout));
    CHECK(check_op("reduce_scatter", dtype, op));
    CHECK(check_count("reduce_scatter", recv_count, item, (size_t)s->n));
    part = recv_count * item;
    count = recv_count * (size_t)s->n;
    nbytes = part * (size_t)s->n;
    CHECK(check_buf("reduce_scatter", "send", send, nbytes));
    CHECK(check_buf("reduce_scatter", "recv", recv, part));
    if (overlaps(recv, part, send, nbytes, part * (size_t)s->me))
        CHECK(say(FERRO_INVALID, "reduce_scatter: recv overlaps send other than at this rank's "
                  "block"));
    if (nbytes > s->L.slot_bytes && !ferro_split_can(s, nbytes, (ptrdiff_t)count))
        CHECK(say(FERRO_UNSUPPORTED, "reduce_scatter: %zu items cannot be split on %d ranks "
                  "with %zu-byte slots", count, s->n, s->L.slot_bytes));
    rc = begin(&k, c, "reduce_scatter", FERRO_COLL_REDUCE_SCATTER, o, timeout, dtype, count, op,
               -1, nbytes);
    if (rc != FERRO_OK) return rc;
    if (nbytes > s->L.slot_bytes || (nbytes >= FERRO_SPLIT_SCATTER_MIN
                                     && nbytes / 4u >= s->split_min
                                     && ferro_split_fits(s, nbytes, (ptrdiff_t)count)))
        rc = ferro_split_start(s, k.header, FERRO_HEADER_BYTES, k.hash, seq_of(&k), send, nbytes,
                               recv, (ptrdiff_t)count, dtype, op,
                               op == FERRO_AVG ? (double)s->n : 0.0, 0, k.hard);
    else
        rc = fold_step(&k, send, nbytes, recv, part * (size_t)s->me, recv_count, dtype, op);
    return finish(&k, rc);
}

static int api_all_gather(ferro_comm* c, const void* send, void* recv, size_t send_count,
                          int dtype, const ferro_opts* o) {
    door_call k;
    double timeout = c->timeout;
    size_t item = ferro_dtype_size(dtype), block;
    int rc;
    ferro_slots* s = &c->s;
    CHECK(ferro_door_check_opts(o, "all_gather", &timeout));
    CHECK(check_dtype("all_gather", dtype));
    CHECK(check_count("all_gather", send_count, item, (size_t)s->n));
    block = send_count * item;
    CHECK(check_buf("all_gather", "send", send, block));
    CHECK(check_buf("all_gather", "recv", recv, block * (size_t)s->n));
    if (overlaps(send, block, recv, block * (size_t)s->n, block * (size_t)s->me))
        CHECK(say(FERRO_INVALID, "all_gather: send overlaps recv other than at this rank's "
                  "block"));
    rc = begin(&k, c, "all_gather", FERRO_COLL_ALL_GATHER, o, timeout, dtype, send_count, -1, -1,
               block * (size_t)s->n);
    if (rc != FERRO_OK) return rc;
    if (block == 0)
        rc = step(&k, NULL, 0, 0);
    else if (block > s->L.slot_bytes)
        rc = ferro_stream_start(s, k.header, FERRO_HEADER_BYTES, k.hash, seq_of(&k), send, block,
                                recv, k.hard);
    else
        rc = copy_step(&k, send, block, recv, -1);
    return finish(&k, rc);
}

static int api_broadcast(ferro_comm* c, const void* send, void* recv, size_t count, int dtype,
                         int root, const ferro_opts* o) {
    door_call k;
    double timeout = c->timeout;
    size_t item = ferro_dtype_size(dtype), nbytes, off, len, chunk;
    int rc, mine;
    ferro_slots* s = &c->s;
    CHECK(ferro_door_check_opts(o, "broadcast", &timeout));
    CHECK(check_dtype("broadcast", dtype));
    CHECK(check_root(c, "broadcast", root));
    CHECK(check_count("broadcast", count, item, 1));
    nbytes = count * item;
    mine = root == s->me;
    if (mine) {
        CHECK(check_buf("broadcast", "send", send, nbytes));
        if (overlaps(send, nbytes, recv, nbytes, 0))
            CHECK(say(FERRO_INVALID, "broadcast: send and recv overlap without being the "
                      "same"));
    }
    CHECK(check_buf("broadcast", "recv", recv, nbytes));
    rc = begin(&k, c, "broadcast", FERRO_COLL_BROADCAST, o, timeout, dtype, count, -1, root,
               nbytes);
    if (rc != FERRO_OK) return rc;
    chunk = broadcast_chunk(s, nbytes, item);
    if (nbytes == 0) rc = step(&k, NULL, 0, 0);
    for (off = 0; off < nbytes && rc == FERRO_OK; off += chunk) {
        len = nbytes - off < chunk ? nbytes - off : chunk;
        rc = copy_step(&k, mine ? (const unsigned char*)send + off : NULL, len,
                       (unsigned char*)recv + off, root);
    }
    return finish(&k, rc);
}

static int api_reduce(ferro_comm* c, const void* send, void* recv, size_t count, int dtype,
                      int op, int root, const ferro_opts* o) {
    door_call k;
    double timeout = c->timeout;
    size_t item = ferro_dtype_size(dtype), nbytes, off, len, chunk;
    int rc, mine;
    ferro_slots* s = &c->s;
    CHECK(ferro_door_check_opts(o, "reduce", &timeout));
    CHECK(check_op("reduce", dtype, op));
    CHECK(check_root(c, "reduce", root));
    CHECK(check_count("reduce", count, item, 1));
    nbytes = count * item;
    mine = root == s->me;
    CHECK(check_buf("reduce", "send", send, nbytes));
    if (mine) {
        CHECK(check_buf("reduce", "recv", recv, nbytes));
        if (overlaps(send, nbytes, recv, nbytes, 0))
            CHECK(say(FERRO_INVALID, "reduce: send and recv overlap without being the same"));
    }
    rc = begin(&k, c, "reduce", FERRO_COLL_REDUCE, o, timeout, dtype, count, op, root, nbytes);
    if (rc != FERRO_OK) return rc;
    chunk = slot_items(s, item);
    if (nbytes == 0) rc = step(&k, NULL, 0, 0);
    for (off = 0; off < nbytes && rc == FERRO_OK; off += chunk) {
        len = nbytes - off < chunk ? nbytes - off : chunk;
        rc = fold_step(&k, (const unsigned char*)send + off, len,
                       mine ? (unsigned char*)recv + off : NULL, 0, len / item, dtype, op);
    }
    return finish(&k, rc);
}

static int api_gather(ferro_comm* c, const void* send, void* recv, size_t send_count, int dtype,
                      int root, const ferro_opts* o) {
    door_call k;
    double timeout = c->timeout;
    size_t item = ferro_dtype_size(dtype), block, off, len, chunk;
    int rc, mine, r;
    ferro_slots* s = &c->s;
    CHECK(ferro_door_check_opts(o, "gather", &timeout));
    CHECK(check_rooted(c, "gather", dtype, root, send_count, "send", send, "recv", recv));
    block = send_count * item;
    mine = root == s->me;
    rc = begin(&k, c, "gather", FERRO_COLL_GATHER, o, timeout, dtype, send_count, -1, root,
               block * (size_t)s->n);
    if (rc != FERRO_OK) return rc;
    if (block == 0 || block <= s->L.slot_bytes) {
        rc = block ? copy_step(&k, send, block, mine ? recv : NULL, -1) : step(&k, NULL, 0, 0);
        return finish(&k, rc);
    }
    chunk = s->L.slot_bytes;
    for (off = 0; off < block && rc == FERRO_OK; off += chunk) {
        len = block - off < chunk ? block - off : chunk;
        rc = step(&k, (const unsigned char*)send + off, len, len);
        if (rc == FERRO_OK && mine)
            for (r = 0; r < s->n; r++)
                memcpy((unsigned char*)recv + (size_t)r * block + off,
                       r == s->me ? (const unsigned char*)send + off : peer_data(s, r), len);
    }
    return finish(&k, rc);
}

/* A step that carries, for every rank r, `len` bytes at `off` of block r (block bytes apart in
 * `blocks`, written by whoever `writes`), placed in r's order in the slot. */
static int blocks_step(door_call* k, const void* blocks, int writes, size_t block, size_t off,
                       size_t len) {
    ferro_slots* s = &k->c->s;
    size_t span = len * (size_t)s->n;
    unsigned char* at;
    int r;
    if (writes) {
        at = next_place(s, span);
        for (r = 0; r < s->n; r++)
            memcpy(at + (size_t)r * len, (const unsigned char*)blocks + (size_t)r * block + off,
                   len);
        s->sent += span;
    }
    return step(k, NULL, 0, span);
}

/* the piece of each block a step carries (a slot holds one of every rank's) */
static size_t piece_bytes(const ferro_slots* s) {
    size_t piece = s->L.slot_bytes / (size_t)s->n;
    return piece >= 128 ? piece / 64 * 64 : piece;
}

static int api_scatter(ferro_comm* c, const void* send, void* recv, size_t recv_count, int dtype,
                       int root, const ferro_opts* o) {
    door_call k;
    double timeout = c->timeout;
    size_t item = ferro_dtype_size(dtype), block, off, len, chunk;
    int rc, mine;
    ferro_slots* s = &c->s;
    CHECK(ferro_door_check_opts(o, "scatter", &timeout));
    CHECK(check_rooted(c, "scatter", dtype, root, recv_count, "recv", recv, "send", send));
    block = recv_count * item;
    mine = root == s->me;
    chunk = piece_bytes(s);
    if (chunk == 0 && block > 0)
        CHECK(say(FERRO_UNSUPPORTED, "scatter: %zu-byte slots hold no piece for %d ranks",
                  s->L.slot_bytes, s->n));
    rc = begin(&k, c, "scatter", FERRO_COLL_SCATTER, o, timeout, dtype, recv_count, -1, root,
               block * (size_t)s->n);
    if (rc != FERRO_OK) return rc;
    if (block * (size_t)s->n <= s->L.slot_bytes) chunk = block;  /* one step, blocks whole */
    if (block == 0) rc = step(&k, NULL, 0, 0);
    for (off = 0; off < block && rc == FERRO_OK; off += chunk) {
        len = block - off < chunk ? block - off : chunk;
        rc = blocks_step(&k, send, mine, block, off, len);
        if (rc == FERRO_OK) {
            const unsigned char* from = mine ? (const unsigned char*)send + block * (size_t)s->me
                                                   + off
                                             : peer_data(s, root) + len * (size_t)s->me;
            if ((unsigned char*)recv + off != from) memcpy((unsigned char*)recv + off, from, len);
        }
    }
    return finish(&k, rc);
}

static int api_all_to_all(ferro_comm* c, const void* send, void* recv, size_t count, int dtype,
                          const ferro_opts* o) {
    door_call k;
    double timeout = c->timeout;
    size_t item = ferro_dtype_size(dtype), block, off, len, chunk;
    int rc, r;
    ferro_slots* s = &c->s;
    CHECK(ferro_door_check_opts(o, "all_to_all", &timeout));
    CHECK(check_dtype("all_to_all", dtype));
    CHECK(check_count("all_to_all", count, item, (size_t)s->n));
    block = count * item;
    CHECK(check_buf("all_to_all", "send", send, block * (size_t)s->n));
    CHECK(check_buf("all_to_all", "recv", recv, block * (size_t)s->n));
    if (overlap(send, block * (size_t)s->n, recv, block * (size_t)s->n))
        CHECK(say(FERRO_INVALID, "all_to_all: send and recv overlap"));
    chunk = piece_bytes(s);
    if (chunk == 0 && block > 0)
        CHECK(say(FERRO_UNSUPPORTED, "all_to_all: %zu-byte slots hold no piece for %d ranks",
                  s->L.slot_bytes, s->n));
    rc = begin(&k, c, "all_to_all", FERRO_COLL_ALL_TO_ALL, o, timeout, dtype,
               count * (size_t)s->n, -1, -1, block * (size_t)s->n);
    if (rc != FERRO_OK) return rc;
    if (block * (size_t)s->n <= s->L.slot_bytes) chunk = block;
    if (block == 0) rc = step(&k, NULL, 0, 0);
    for (off = 0; off < block && rc == FERRO_OK; off += chunk) {
        len = block - off < chunk ? block - off : chunk;
        rc = blocks_step(&k, send, 1, block, off, len);
        if (rc != FERRO_OK) break;
        for (r = 0; r < s->n; r++)
            memcpy((unsigned char*)recv + (size_t)r * block + off,
                   r == s->me ? (const unsigned char*)send + (size_t)r * block + off
                              : peer_data(s, r) + len * (size_t)s->me,
                   len);
    }
    return finish(&k, rc);
}

/* ------------------------------------------------------------------ errors */
static const char* api_last_error(void) { return last_msg; }

static const char* api_status_name(int status) {
    static const char* const names[] = {"FERRO_OK", "FERRO_TIMEOUT", "FERRO_FAILED",
                                        "FERRO_MISMATCH", "FERRO_INVALID", "FERRO_CLOSED",
                                        "FERRO_BUSY", "FERRO_UNSUPPORTED", "FERRO_NOMEM",
                                        "FERRO_SEGMENT_VERSION"};
    if (status < 0 || status > (int)FERRO_VERSION) return "FERRO_UNKNOWN";
    return names[status];
}

static const ferro_engine_api TABLE = {
    FERRO_ENGINE_ABI_MAJOR, FERRO_ENGINE_ABI_MINOR, sizeof(ferro_engine_api),
    api_rank, api_world_size, api_default_timeout, api_retain, api_release, api_close,
    api_reserve, api_skip, api_set_stall_report,
    api_barrier, api_allreduce, api_reduce, api_reduce_scatter, api_all_gather, api_gather,
    api_scatter, api_broadcast, api_all_to_all,
    ferro_door_send, ferro_door_recv,
    api_last_error, api_status_name,
};
