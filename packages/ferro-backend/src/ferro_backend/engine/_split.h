/* The split allreduce: every rank folds one part of the data, pipelined in chunks, so that the
 * ranks copy, fold and gather at the same time instead of each folding everything.
 *
 * Included by _steps.h (it uses ferro_slots); ferro_api_allreduce runs it for an allreduce of
 * at least split_min bytes that fits a slot. The data splits into n parts (rank r owns part r,
 * items [r*q + min(r, m), ...) for count = n*q + m), each part into chunks of `chunk` bytes.
 * A call takes two steps, s and s + 1:
 *
 *   start  header and this rank's progress counters (in_base, out_base) into slot s % 2,
 *          publish s, wait for every rank, compare headers (the one step-word wait: a mismatch
 *          is found before any data moves);
 *   C k    copy chunk k of every other rank's part from the input into slot s % 2 (at the
 *          data's own offset), then publish inprog = in_base + k + 1;
 *   F k    wait until every rank's inprog reached its in_base + k + 1; chunk k of this rank's
 *          part in slot (s + 1) % 2 = the rank-order fold of every rank's (this rank's from its
 *          input), then copied into out; publish outprog = out_base + k + 1;
 *   G k    wait until every rank's outprog reached out_base + k + 1; copy chunk k of every
 *          other rank's part from its slot (s + 1) % 2 into out.
 *
 * The pipeline runs C 0; C 1, F 0; C 2, F 1, G 0; ...: each wait is for work the peers did one
 * stage earlier. Each element is folded in rank order, as every engine fold is, so the bits
 * equal the one-step fold's. Slot (s + 1) % 2 is free: every rank published s, so it finished
 * step s - 1. Slot s % 2 is free again when a rank has gathered everything (every rank folded,
 * so read, all it needed); slot (s + 1) % 2 is written next at step s + 3, after every rank has
 * published s + 2, which it does after this call. The counters are read relative to the bases
 * each rank published at the start, so a call that failed half-way leaves nothing behind.
 *
 * A wait that ends at the soft deadline returns FERRO_TIMEOUT with the next action kept
 * (split.active); ferro_split_run resumes it (SlotEngine.fold, after the stall report).
 * Every rank's bases are copied at the start (split.bases, 2n words SlotEngine allocates):
 * a peer done first starts its next step in the slot that held them.
 */
#ifndef FERRO_SPLIT_H
#define FERRO_SPLIT_H

enum { FERRO_KIND_SPLIT = 0, FERRO_KIND_STREAM = 1 };

static inline int ferro_stream_run(ferro_slots* s, double deadline);

/* chunk bytes: a part in about FERRO_SPLIT_CHUNKS chunks, within these bounds */
#define FERRO_SPLIT_CHUNK_MIN 4096u
#define FERRO_SPLIT_CHUNK_MAX 65536u
#define FERRO_SPLIT_CHUNKS 4u

/* rank r's part: its first item and its item count */
static inline void ferro_split_part(const ferro_split* sp, int n, int r, Py_ssize_t* first,
                                    Py_ssize_t* len) {
    Py_ssize_t q = sp->count / n, m = sp->count % n;
    *first = (Py_ssize_t)r * q + (r < m ? r : m);
    *len = q + (r < m ? 1 : 0);
}

/* the bytes [*off, *off + return value) of chunk k of rank r's part (0 bytes: past its end) */
static inline size_t ferro_split_chunk(const ferro_split* sp, int n, int r, int k, size_t* off) {
    Py_ssize_t first, len;
    size_t start, end, at;
    ferro_split_part(sp, n, r, &first, &len);
    start = (size_t)first * sp->itemsize;
    end = start + (size_t)len * sp->itemsize;
    at = start + (size_t)k * sp->chunk;
    *off = at;
    if (at >= end) return 0;
    return end - at < sp->chunk ? end - at : sp->chunk;
}

/* Whether the split path takes a whole allreduce of count items in nbytes. */
static inline int ferro_split_fits(const ferro_slots* s, size_t nbytes, Py_ssize_t count) {
    return s->split_min > 0 && s->split.bases != NULL && nbytes >= s->split_min && s->n > 1
        && count >= s->n && nbytes % (size_t)count == 0 && nbytes <= s->L.slot_bytes
        && s->fold != NULL;
}

/* Every rank's progress counters at the start (its slot of the first step), kept: a peer that
 * finishes first starts its next step in that slot while this rank still waits on it. */
static inline void ferro_split_bases(ferro_slots* s) {
    ferro_slot_head* h;
    int j;
    for (j = 0; j < s->n; j++) {
        h = ferro_slots_slot(s, j, s->split.step);
        s->split.bases[2 * j] = h->in_base;
        s->split.bases[2 * j + 1] = h->out_base;
    }
}

/* Wait until every other rank's progress word (which: 0 inprog, 1 outprog) has reached its
 * base (read from its slot of the call's first step) plus k + 1. */
static inline int ferro_split_wait(ferro_slots* s, int which, int k, double deadline) {
    int j, rc = FERRO_OK;
    ferro_ctrl* c;
    uint32_t target;
    double t0 = s->clock ? ferro_now() : 0.0;
    for (j = 0; j < s->n && rc == FERRO_OK; j++) {
        if (j == s->me) continue;
        c = ferro_ctrl_of(s->base, &s->L, j);
        target = s->split.bases[2 * j + which] + (uint32_t)k + 1u;
        rc = ferro_wait(&s->pol, which ? &c->outprog : &c->inprog, target, FERRO_UNTIL_REACHED,
                        which ? &c->out_sleepers : &c->in_sleepers, deadline, s->failed, NULL,
                        0.0);
    }
    if (s->clock) s->waited += ferro_now() - t0;
    return rc;
}

/* C k: this rank's input chunk k of every other part into its slot of the first step */
static inline void ferro_split_copy_in(ferro_slots* s, int k) {
    ferro_split* sp = &s->split;
    unsigned char* slot = ferro_slot_data(ferro_slots_slot(s, s->me, sp->step));
    ferro_ctrl* c = ferro_ctrl_of(s->base, &s->L, s->me);
    size_t off, len;
    int r;
    for (r = 0; r < s->n; r++) {
        if (r == s->me) continue;
        len = ferro_split_chunk(sp, s->n, r, k, &off);
        if (len) {
            memcpy(slot + off, sp->src + off, len);
            s->sent += len;
        }
    }
    ferro_publish(&c->inprog, c->inprog + 1u, &c->in_sleepers);
}

/* F k: chunk k of this rank's part, folded from every rank into its result slot (never one of
 * the inputs, which an in-place call's out is), then copied into out */
static inline int ferro_split_fold(ferro_slots* s, int k, const void** ptrs) {
    ferro_split* sp = &s->split;
    ferro_ctrl* c = ferro_ctrl_of(s->base, &s->L, s->me);
    size_t off, len = ferro_split_chunk(sp, s->n, s->me, k, &off);
    unsigned char* res = ferro_slot_data(ferro_slots_slot(s, s->me, sp->step + 1)) + off;
    int j, rc = 0;
    if (len) {
        for (j = 0; j < s->n; j++)
            ptrs[j] = j == s->me ? sp->src + off
                                 : ferro_slot_data(ferro_slots_slot(s, j, sp->step)) + off;
        rc = s->fold(sp->code, res, ptrs, s->n, (Py_ssize_t)(len / sp->itemsize), sp->op,
                     sp->mean_divisor);
        memcpy(sp->out + off, res, len);
    }
    ferro_publish(&c->outprog, c->outprog + 1u, &c->out_sleepers);
    return rc;
}

/* G k: chunk k of every other rank's part from its result slot into out */
static inline void ferro_split_gather(ferro_slots* s, int k) {
    ferro_split* sp = &s->split;
    size_t off, len;
    int r;
    for (r = 0; r < s->n; r++) {
        if (r == s->me) continue;
        len = ferro_split_chunk(sp, s->n, r, k, &off);
        if (len)
            memcpy(sp->out + off,
                   ferro_slot_data(ferro_slots_slot(s, r, sp->step + 1)) + off, len);
    }
}

/* The pipeline from action split.next on (action a: stage t = a / 3 runs C t, F t - 1 and
 * G t - 2, those that exist); FERRO_OK when the call is done (then step s + 1 is published),
 * else what the wait returned (split.next kept), or -1 (no fold kernel for the dtype code). */
static inline int ferro_split_run(ferro_slots* s, double deadline) {
    ferro_split* sp = &s->split;
    const void* few[64];
    const void** ptrs = few;
    int rc = FERRO_OK, k, t, K = sp->nchunks;
    if (s->n > 64) {
        ptrs = (const void**)malloc((size_t)s->n * sizeof(void*));
        if (ptrs == NULL) return -1;
    }
    for (; sp->next < 3 * (K + 2); sp->next++) {
        t = sp->next / 3;
        switch (sp->next % 3) {
        case 0:
            if (t < K) ferro_split_copy_in(s, t);
            break;
        case 1:
            k = t - 1;
            if (k < 0 || k >= K) break;
            rc = ferro_split_wait(s, 0, k, deadline);
            if (rc == FERRO_OK && ferro_split_fold(s, k, ptrs) != 0) rc = -1;
            break;
        default:
            k = t - 2;
            if (k < 0 || k >= K) break;
            rc = ferro_split_wait(s, 1, k, deadline);
            if (rc == FERRO_OK) ferro_split_gather(s, k);
        }
        if (rc != FERRO_OK) break;
    }
    if (ptrs != few) free(ptrs);
    if (rc != FERRO_OK) return rc;
    sp->active = 0;
    s->step = sp->step + 1;
    ferro_slots_publish(s, s->step);
    return FERRO_OK;
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
    rc = ferro_slots_step(s, header, hlen, 1, hash, seq, NULL, 0, deadline, 0);
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
    return s->split.kind == FERRO_KIND_STREAM ? ferro_stream_run(s, deadline)
                                              : ferro_split_run(s, deadline);
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

/* A whole split allreduce (called without the GIL): the start step, then the pipeline. */
static inline int ferro_split_start(ferro_slots* s, const unsigned char* header, size_t hlen,
                                    uint64_t hash, uint32_t seq, const void* src, size_t nbytes,
                                    void* out, Py_ssize_t count, int code, int op,
                                    double mean_divisor, double deadline) {
    ferro_split* sp = &s->split;
    size_t part, chunk;
    int rc = ferro_split_begin(s, header, hlen, hash, seq, deadline);
    sp->kind = FERRO_KIND_SPLIT;
    sp->src = (const unsigned char*)src;
    sp->out = (unsigned char*)out;
    sp->count = count;
    sp->itemsize = nbytes / (size_t)count;
    sp->code = code;
    sp->op = op;
    sp->mean_divisor = mean_divisor;
    part = ((size_t)count + (size_t)s->n - 1) / (size_t)s->n * sp->itemsize;
    chunk = part / FERRO_SPLIT_CHUNKS;
    if (chunk < FERRO_SPLIT_CHUNK_MIN) chunk = FERRO_SPLIT_CHUNK_MIN;
    if (chunk > FERRO_SPLIT_CHUNK_MAX) chunk = FERRO_SPLIT_CHUNK_MAX;
    chunk = (chunk + 63u) / 64u * 64u;                       /* whole cache lines */
    chunk = (chunk + sp->itemsize - 1) / sp->itemsize * sp->itemsize;  /* whole items */
    sp->chunk = chunk;
    sp->nchunks = (int)((part + chunk - 1) / chunk);
    return ferro_split_go(s, rc, deadline);
}

#endif
