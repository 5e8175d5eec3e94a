/* The split reduction: every rank folds one part of the data, pipelined in chunks through
 * rings in its two slots, so that the ranks copy, fold and gather at the same time instead of
 * each folding everything, at any size (the rings wrap beyond a slot).
 *
 * On the steps of _steps.h. Two forms: the allreduce (split.gather = 1:
 * every rank ends with every part; ferro_api_allreduce runs it for an allreduce of at least
 * split_min bytes) and the reduce_scatter (gather = 0: a rank ends with its own part only;
 * ferro_api_reduce_scatter runs it from FERRO_SPLIT_SCATTER_MIN bytes and 4 split_min).
 * The data splits into n parts (rank r owns part r, items [r*q + min(r, m), ...) for count =
 * n*q + m), each part into K chunks of `chunk` bytes. Rings, in slot units of W = slot_bytes:
 *
 *   input ring   slot s % 2, part r's sub-ring at r * in_stride: in_ring positions of a chunk;
 *                chunk k of part r goes to position k % in_ring (a rank's own sub-ring idles)
 *   result ring  slot (s + 1) % 2 (allreduce only): out_ring positions; chunk k of this rank's
 *                folded part goes to position k % out_ring
 *
 * A call takes two steps, s and s + 1:
 *
 *   start  header and this rank's progress counters (in_base, out_base, g_base) into slot
 *          s % 2, publish s, wait for every rank, compare headers (the one step-word wait: a
 *          mismatch is found before any data moves);
 *   C k    for every other rank r: once r has folded chunk k - in_ring (its outprog reached
 *          out_base + k - in_ring + 1: it has read the position), copy chunk k of part r from
 *          the input into r's sub-ring; then publish inprog = in_base + k + 1;
 *   F k    wait until every rank's inprog reached its in_base + k + 1; the rank-order fold of
 *          chunk k of this rank's part (its own from its input, the others' from their input
 *          rings). Allreduce: into the result ring (once every rank has gathered chunk k -
 *          out_ring: gprog reached g_base + k - out_ring + 1), then copied into out;
 *          reduce_scatter: straight into out. Publish outprog = out_base + k + 1;
 *   G k    (allreduce) wait until every rank's outprog reached out_base + k + 1; copy chunk k
 *          of every other rank's part from its result ring into out; publish gprog.
 *
 * The pipeline runs C 0; C 1, F 0; C 2, F 1, G 0; ...: each wait is for work the peers did one
 * stage earlier (or, when a ring wraps, a few stages earlier). Each element is folded in rank
 * order, as every engine fold is, so the bits equal the one-step fold's. Slot (s + 1) % 2 is
 * free: every rank published s, so it finished step s - 1. A rank's next call may write slot
 * s % 2 at once (a one-step call writes before it waits): it ends this call only when every
 * peer has folded every chunk (read its input ring): the allreduce's last G implies it, the
 * reduce_scatter waits for it. Slot (s + 1) % 2 is next written at step s + 3, after every
 * rank has published s + 2, so after this call. The counters are read relative to the bases
 * each rank published at the start, so a call that failed half-way leaves nothing behind.
 *
 * A wait that ends at the soft deadline returns FERRO_TIMEOUT with the next action kept
 * (split.active); ferro_split_run resumes it (SlotEngine.fold, after the stall report).
 * Every rank's bases are copied at the start (split.bases, 3n words SlotEngine allocates):
 * a peer done first starts its next step in the slot that held them.
 */
#ifndef FERRO_SPLIT_H
#define FERRO_SPLIT_H

#include "_steps.h"

enum { FERRO_KIND_SPLIT = 0, FERRO_KIND_STREAM = 1 };
/* which progress word a wait reads */
enum { FERRO_PROG_IN = 0, FERRO_PROG_OUT = 1, FERRO_PROG_GATHER = 2 };

/* chunk bytes: a whole part, within these bounds, and at most a quarter of a part's input
 * sub-ring (half in tiny slots), so that a ring of a few chunks pipelines. Fewer, larger chunks
 * won in both of the states this host's two cores were measured in (2 processes, medians of
 * 10-30 launches each; a part in 4 chunks of at most 64 KiB before): allreduce 64 KiB 3.1 ->
 * 2.9 us with the cores apart, 8.7 -> 6.4 us with them far apart; 1 MiB 43.5 -> 38.7 and
 * 66.3 -> 61.9 us. */
#define FERRO_SPLIT_CHUNK_MIN 4096u
#define FERRO_SPLIT_CHUNK_MAX 131072u
/* a reduce_scatter of this many bytes or more, and of at least 4 times the split threshold
 * (which oversubscribed jobs raise), runs split even within a slot: each rank copies only the
 * others' parts into its slot, pipelined, instead of all of its input. 2 processes, 1 MiB:
 * 35.7 -> 25.0 us with the cores apart, 90.9 -> 34.4 with them far apart; 256 KiB 9.6 -> 5.4
 * and 11.6 -> 11.8; at 64 KiB the one step was as fast apart and faster far apart (3.4
 * against 4.3 us). 4 processes on 2 cores: 1 MiB 193 -> 107 us, 256 KiB (split from 128 KiB
 * there) 28.8 -> 33.4, so that stays one step (the factor 4). */
#define FERRO_SPLIT_SCATTER_MIN 262144u

/* rank r's part: its first item and its item count */
static inline void ferro_split_part(const ferro_split* sp, int n, int r, ptrdiff_t* first,
                                    ptrdiff_t* len) {
    ptrdiff_t q = sp->count / n, m = sp->count % n;
    *first = (ptrdiff_t)r * q + (r < m ? r : m);
    *len = q + (r < m ? 1 : 0);
}

/* the bytes [*off, *off + return value) of the data that chunk k of rank r's part holds (0
 * bytes: past its end) */
static inline size_t ferro_split_chunk(const ferro_split* sp, int n, int r, int k, size_t* off) {
    ptrdiff_t first, len;
    size_t start, end, at;
    ferro_split_part(sp, n, r, &first, &len);
    start = (size_t)first * sp->itemsize;
    end = start + (size_t)len * sp->itemsize;
    at = start + (size_t)k * sp->chunk;
    *off = at;
    if (at >= end) return 0;
    return end - at < sp->chunk ? end - at : sp->chunk;
}

/* Whether the split path can take a whole reduction of count items in nbytes (any size: the
 * rings wrap), whatever split_min says. */
static inline int ferro_split_can(const ferro_slots* s, size_t nbytes, ptrdiff_t count) {
    return s->split.bases != NULL && s->n > 1 && count >= s->n && nbytes % (size_t)count == 0
        && s->L.slot_bytes / (2u * (size_t)s->n) >= nbytes / (size_t)count;
}

/* Whether the one-call allreduce (within a slot) runs split: from split_min bytes. */
static inline int ferro_split_fits(const ferro_slots* s, size_t nbytes, ptrdiff_t count) {
    return s->split_min > 0 && nbytes >= s->split_min && nbytes <= s->L.slot_bytes
        && ferro_split_can(s, nbytes, count);
}

/* Every rank's progress counters at the start (its slot of the first step), kept: a peer that
 * finishes first starts its next step in that slot while this rank still waits on it. */
static inline void ferro_split_bases(ferro_slots* s) {
    ferro_slot_head* h;
    int j;
    for (j = 0; j < s->n; j++) {
        h = ferro_slots_slot(s, j, s->split.step);
        s->split.bases[3 * j] = h->in_base;
        s->split.bases[3 * j + 1] = h->out_base;
        s->split.bases[3 * j + 2] = h->g_base;
    }
}

/* Wait until rank j's progress word `which` has reached its base plus k + 1. */
static inline int ferro_split_wait_one(ferro_slots* s, int j, int which, int k,
                                       double deadline) {
    ferro_ctrl* c = ferro_ctrl_of(s->base, &s->L, j);
    uint32_t target = s->split.bases[3 * j + which] + (uint32_t)k + 1u;
    uint32_t* word = which == FERRO_PROG_IN ? &c->inprog
                     : which == FERRO_PROG_OUT ? &c->outprog : &c->gprog;
    uint32_t* sleepers = which == FERRO_PROG_IN ? &c->in_sleepers
                         : which == FERRO_PROG_OUT ? &c->out_sleepers : &c->g_sleepers;
    int rc;
    double t0 = s->clock ? ferro_now() : 0.0;
    s->split.wait_which = which;  /* (what ferro_comm_missing names the late ranks by) */
    s->split.wait_k = k;
    rc = ferro_slots_wait_word(s, word, target, sleepers, deadline);
    if (s->clock) s->waited += ferro_now() - t0;
    if (rc == FERRO_OK) s->split.wait_which = -1;
    return rc;
}

/* Wait until every other rank's progress word `which` has reached its base plus k + 1. */
static inline int ferro_split_wait(ferro_slots* s, int which, int k, double deadline) {
    int j, rc = FERRO_OK;
    for (j = 0; j < s->n && rc == FERRO_OK; j++)
        if (j != s->me) rc = ferro_split_wait_one(s, j, which, k, deadline);
    return rc;
}

/* where chunk k of part r sits in rank j's input ring: the rings go on where j's last call
 * left them (from its progress counter at the start, which every rank has read), so that a
 * call writes the positions its peers read longest ago (see ferro_slots_rot) */
static inline unsigned char* ferro_split_in_at(ferro_slots* s, int j, int r, int k) {
    const ferro_split* sp = &s->split;
    return ferro_slot_data(ferro_slots_slot(s, j, sp->step)) + (size_t)r * sp->in_stride
        + (size_t)((sp->bases[3 * j] + (uint32_t)k) % (uint32_t)sp->in_ring) * sp->chunk;
}

/* where chunk k of rank j's folded part sits in its result ring (going on likewise) */
static inline unsigned char* ferro_split_out_at(ferro_slots* s, int j, int k) {
    const ferro_split* sp = &s->split;
    return ferro_slot_data(ferro_slots_slot(s, j, sp->step + 1))
        + (size_t)((sp->bases[3 * j + 1] + (uint32_t)k) % (uint32_t)sp->out_ring) * sp->chunk;
}

/* C k: this rank's input chunk k of every other part into that part's sub-ring, each position
 * once its reader has folded what it held */
static inline int ferro_split_copy_in(ferro_slots* s, int k, double deadline) {
    ferro_split* sp = &s->split;
    ferro_ctrl* c = ferro_ctrl_of(s->base, &s->L, s->me);
    size_t off, len;
    int r, rc;
    for (r = 0; r < s->n; r++) {
        if (r == s->me) continue;
        len = ferro_split_chunk(sp, s->n, r, k, &off);
        if (!len) continue;
        if (k >= sp->in_ring) {
            rc = ferro_split_wait_one(s, r, FERRO_PROG_OUT, k - sp->in_ring, deadline);
            if (rc != FERRO_OK) return rc;  /* resumed here: a chunk copied twice is harmless */
        }
        ferro_put_copy(&s->put, ferro_split_in_at(s, s->me, r, k), sp->src + off, len);
        s->sent += len;
    }
    ferro_publish(&c->inprog, c->inprog + 1u, &c->in_sleepers);
    return FERRO_OK;
}

/* F k: chunk k of this rank's part, folded from every rank (its own from its input), into its
 * result ring and then out (allreduce), or straight into out (reduce_scatter; never one of the
 * inputs, since an in-place call's out is) */
static inline int ferro_split_fold(ferro_slots* s, int k, const void** ptrs, double deadline) {
    ferro_split* sp = &s->split;
    ferro_ctrl* c = ferro_ctrl_of(s->base, &s->L, s->me);
    size_t off, len = ferro_split_chunk(sp, s->n, s->me, k, &off);
    unsigned char* res;
    int j, rc;
    if (len) {
        if (sp->gather && k >= sp->out_ring) {
            rc = ferro_split_wait(s, FERRO_PROG_GATHER, k - sp->out_ring, deadline);
            if (rc != FERRO_OK) return rc;
        }
        for (j = 0; j < s->n; j++)
            ptrs[j] = j == s->me ? sp->src + off : ferro_split_in_at(s, j, s->me, k);
        /* straight into out, then (allreduce) out into the result ring: one pass fewer
         * than through the scratch chunk. Where out overlaps the inputs (an in-place call),
         * the fold writes out only where it is this rank's own input item for item and that
         * input is the first or second folded (the fold combines those two in one pass
         * before it reads any other); else into the scratch chunk, then out (and the ring) */
        res = !sp->aliased || (sp->out == sp->src && s->me < 2) ? sp->out + off - sp->out_shift
                                                                 : sp->scratch;
        if (ferro_fold(sp->code, res, (const void* const*)ptrs, s->n, (ptrdiff_t)(len / sp->itemsize), sp->op,
                    sp->mean_divisor) != 0)
            return -1;
        if (sp->gather) ferro_put_copy(&s->put, ferro_split_out_at(s, s->me, k), res, len);
        if (res == sp->scratch) memcpy(sp->out + off - sp->out_shift, res, len);
    }
    ferro_publish(&c->outprog, c->outprog + 1u, &c->out_sleepers);
    return FERRO_OK;
}

/* G k: chunk k of every other rank's part from its result ring into out */
static inline void ferro_split_gather(ferro_slots* s, int k) {
    ferro_split* sp = &s->split;
    ferro_ctrl* c = ferro_ctrl_of(s->base, &s->L, s->me);
    size_t off, len;
    int r;
    for (r = 0; r < s->n; r++) {
        if (r == s->me) continue;
        len = ferro_split_chunk(sp, s->n, r, k, &off);
        if (len) memcpy(sp->out + off, ferro_split_out_at(s, r, k), len);
    }
    ferro_publish(&c->gprog, c->gprog + 1u, &c->g_sleepers);
}

/* A split or streamed call is over on this rank: its second step is published. */
static inline int ferro_split_end(ferro_slots* s) {
    s->split.active = 0;
    s->step = s->split.step + 1;
    ferro_slots_publish(s, s->step);
    return FERRO_OK;
}

/* The pipeline from action split.next on (action a: stage t = a / 3 runs C t, F t - 1 and
 * G t - 2, those that exist; the last action waits, for a reduce_scatter, until every rank has
 * folded everything); FERRO_OK when the call is done (then step s + 1 is published), else what
 * the wait returned (split.next kept), or -1 (no fold kernel for the dtype code). */
static inline int ferro_split_run(ferro_slots* s, double deadline) {
    ferro_split* sp = &s->split;
    const void* few[64];
    const void** ptrs = few;
    int rc = FERRO_OK, k, t, K = sp->nchunks;
    if (s->n > 64) {
        ptrs = (const void**)malloc((size_t)s->n * sizeof(void*));
        if (ptrs == NULL) return -1;
    }
    for (; sp->next <= 3 * (K + 2); sp->next++) {
        t = sp->next / 3;
        if (sp->next == 3 * (K + 2)) {  /* the end */
            if (!sp->gather && K > 0) rc = ferro_split_wait(s, FERRO_PROG_OUT, K - 1, deadline);
        } else if (sp->next % 3 == 0) {
            if (t < K) rc = ferro_split_copy_in(s, t, deadline);
        } else if (sp->next % 3 == 1) {
            k = t - 1;
            if (k < 0 || k >= K) continue;
            rc = ferro_split_wait(s, FERRO_PROG_IN, k, deadline);
            if (rc == FERRO_OK) rc = ferro_split_fold(s, k, ptrs, deadline);
        } else if (sp->gather) {
            k = t - 2;
            if (k < 0 || k >= K) continue;
            rc = ferro_split_wait(s, FERRO_PROG_OUT, k, deadline);
            if (rc == FERRO_OK) ferro_split_gather(s, k);
        }
        if (rc != FERRO_OK) break;
    }
    if (ptrs != few) free(ptrs);
    return rc != FERRO_OK ? rc : ferro_split_end(s);
}

/* The start step of a split or streamed call: this rank's progress counters (the bases) and
 * the header into its slot, publish, wait, compare headers; the call's first step is kept. */
static inline int ferro_split_begin(ferro_slots* s, const unsigned char* header, size_t hlen,
                                    uint64_t hash, uint32_t seq, double deadline) {
    ferro_ctrl* c = ferro_ctrl_of(s->base, &s->L, s->me);
    ferro_slot_head* mine = ferro_slots_slot(s, s->me, s->step + 1);
    int rc;
    mine->in_base = c->inprog;
    mine->out_base = c->outprog;
    mine->g_base = c->gprog;
    rc = ferro_slots_exchange(s, header, hlen, 1, hash, seq, NULL, 0, 0, deadline);
    s->split.step = s->step;
    return rc;
}

/* The rest of a split or streamed call from its next action (after a wait that ended early:
 * what SlotEngine.resume runs); as ferro_split_run returns. */
static inline int ferro_split_resume(ferro_slots* s, double deadline) {
    if (s->split.active == 2) {  /* the start's wait ended late: the bases are there now */
        ferro_split_bases(s);
        s->split.active = 1;
    }
    return s->split.run(s, deadline);
}

/* After the start step (its result rc): the pipeline, or the start's wait kept to resume. */
static inline int ferro_split_go(ferro_slots* s, int rc, double deadline) {
    s->split.next = 0;
    if (rc != FERRO_OK) {  /* resumed once the wait ends (not after a mismatch or failure) */
        s->split.active = rc == FERRO_TIMEOUT ? 2 : 0;
        return rc;
    }
    s->split.active = 2;
    return ferro_split_resume(s, deadline);
}

/* A whole split reduction (called without the GIL; ferro_split_can holds): the start step,
 * then the pipeline. gather: an allreduce (out: count items); else a reduce_scatter (out: this
 * rank's part, count / n items; count a multiple of n). */
static inline int ferro_split_start(ferro_slots* s, const unsigned char* header, size_t hlen,
                                    uint64_t hash, uint32_t seq, const void* src, size_t nbytes,
                                    void* out, ptrdiff_t count, int code, int op,
                                    double mean_divisor, int gather, double deadline) {
    ferro_split* sp = &s->split;
    size_t part, chunk, room = s->L.slot_bytes / (size_t)s->n;
    ptrdiff_t first, len;
    int rc = ferro_split_begin(s, header, hlen, hash, seq, deadline);
    sp->kind = FERRO_KIND_SPLIT;
    sp->run = ferro_split_run;
    sp->gather = gather;
    sp->src = (const unsigned char*)src;
    sp->out = (unsigned char*)out;
    sp->count = count;
    sp->itemsize = nbytes / (size_t)count;
    sp->code = code;
    sp->op = op;
    sp->mean_divisor = mean_divisor;
    ferro_split_part(sp, s->n, s->me, &first, &len);
    sp->out_shift = gather ? 0 : (size_t)first * sp->itemsize;
    sp->aliased = (const unsigned char*)out < sp->src + nbytes
        && sp->src < (const unsigned char*)out + (gather ? nbytes : (size_t)len * sp->itemsize);
    part = ((size_t)count + (size_t)s->n - 1) / (size_t)s->n * sp->itemsize;
    chunk = part;
    if (chunk < FERRO_SPLIT_CHUNK_MIN) chunk = FERRO_SPLIT_CHUNK_MIN;
    if (chunk > FERRO_SPLIT_CHUNK_MAX) chunk = FERRO_SPLIT_CHUNK_MAX;
    if (chunk > room / 4) chunk = room / 4;                  /* rings of >= 4 positions */
    chunk = (chunk + 63u) / 64u * 64u;                       /* whole cache lines */
    chunk = (chunk + sp->itemsize - 1) / sp->itemsize * sp->itemsize;  /* whole items */
    /* tiny slots: still rings of >= 2 positions (with one, C k and a peer's F k - 1 would
     * wait for each other) */
    if (chunk > room / 2) chunk = room / 2 / sp->itemsize * sp->itemsize;
    sp->chunk = chunk;
    sp->nchunks = (int)((part + chunk - 1) / chunk);
    ferro_put_choose(&s->put, nbytes, 1);
    sp->in_ring = (int)(room / chunk);
    sp->in_stride = (size_t)sp->in_ring * chunk;
    sp->out_ring = (int)(s->L.slot_bytes / chunk);
    return ferro_split_go(s, rc, deadline);
}

#endif
