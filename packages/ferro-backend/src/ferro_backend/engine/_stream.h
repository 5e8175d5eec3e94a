/* The streamed all_gather: blocks larger than a slot, pipelined through each rank's two slots.
 *
 * On the split step of _split.h (it shares its state, bases and waits).
 * Cross-memory reads (process_vm_readv) pin the peer's pages one by one: here they move 1.4-3.9
 * GB/s, while a plain copy moves 9-15. Two plain copies, the owner's into its slot and each
 * reader's out of it, run at the same time on different cores, so a block crosses at about one
 * copy's speed. A call takes steps s and s + 1; their two slots are a ring of M chunks of
 * `chunk` bytes (chunk i in slot (s + (i % M) / (M / 2)) % 2, at ((i % M) % (M / 2)) * chunk):
 *
 *   start  as the split allreduce's (header and bases, publish s, wait, compare headers);
 *   W i    wait until every rank consumed chunk i - M of every block (its outprog reached
 *          out_base + i - M + 1); copy chunk i of this rank's block into the ring; publish
 *          inprog = in_base + i + 1;
 *   R i    wait until every rank wrote chunk i (inprog reached in_base + i + 1); copy chunk i
 *          of every other rank's block into out; publish outprog = out_base + i + 1.
 *
 * Stage t runs W t and R t - 1; W t also copies chunk t of this rank's own block into out,
 * after publishing it. A rank ends the call only when every peer has read the last of its
 * chunks in slot s % 2, which its next call may write at once (a one-step call writes before
 * it waits); slot (s + 1) % 2 is next written at step s + 3, after every rank has published
 * s + 2.
 */
#ifndef FERRO_STREAM_H
#define FERRO_STREAM_H

#include "_split.h"


/* chunks in the ring (both slots); a chunk is slot_bytes / (FERRO_STREAM_RING / 2) */
#define FERRO_STREAM_RING 8

static inline unsigned char* ferro_stream_at(ferro_slots* s, int rank, int i) {
    int m = i % FERRO_STREAM_RING, half = FERRO_STREAM_RING / 2;
    return ferro_slot_data(ferro_slots_slot(s, rank, s->split.step + (uint32_t)(m / half)))
        + (size_t)(m % half) * s->split.chunk;
}

/* bytes of chunk i of a block (itemsize holds the block's size) */
static inline size_t ferro_stream_len(const ferro_split* sp, int i) {
    size_t at = (size_t)i * sp->chunk;
    return sp->itemsize - at < sp->chunk ? sp->itemsize - at : sp->chunk;
}

/* The pipeline from action split.next on (action a: stage a / 2 runs W (a even) or R): as
 * ferro_split_run returns. */
static inline int ferro_stream_run(ferro_slots* s, double deadline) {
    ferro_split* sp = &s->split;
    ferro_ctrl* c = ferro_ctrl_of(s->base, &s->L, s->me);
    size_t block = sp->itemsize, len, at;
    unsigned char* mine = sp->out + (size_t)s->me * block;
    int rc = FERRO_OK, i, r, K = sp->nchunks;
    for (; sp->next < 2 * (K + 1); sp->next++) {
        i = sp->next / 2;
        if (sp->next % 2 == 0) {  /* W i */
            if (i >= K) continue;
            if (i >= FERRO_STREAM_RING) {
                rc = ferro_split_wait(s, FERRO_PROG_OUT, i - FERRO_STREAM_RING, deadline);
                if (rc != FERRO_OK) break;
            }
            len = ferro_stream_len(sp, i);
            at = (size_t)i * sp->chunk;
            ferro_put_copy(&s->put, ferro_stream_at(s, s->me, i), sp->src + at, len);
            s->sent += len;
            ferro_publish(&c->inprog, c->inprog + 1u, &c->in_sleepers);
            /* the same chunk of this rank's own block into out, read again from the cache */
            if (mine != sp->src) ferro_stream_copy(mine + at, sp->src + at, len);
        } else {  /* R i - 1 */
            i -= 1;
            if (i < 0 || i >= K) continue;
            rc = ferro_split_wait(s, FERRO_PROG_IN, i, deadline);
            if (rc != FERRO_OK) break;
            len = ferro_stream_len(sp, i);
            for (r = 0; r < s->n; r++)  /* out is read by nobody soon: no read-for-ownership */
                if (r != s->me)
                    ferro_stream_copy(sp->out + (size_t)r * block + (size_t)i * sp->chunk,
                                      ferro_stream_at(s, r, i), len);
            ferro_publish(&c->outprog, c->outprog + 1u, &c->out_sleepers);
        }
    }
    if (rc != FERRO_OK) return rc;
    /* This rank's next call may take one step, and a one-step call writes its slot, (s + 2)
     * % 2 = s % 2, before it waits for anyone: every peer must have read the chunks of this
     * rank's block that sit there first (the last of them is enough: chunks are read in
     * order). Chunks in slot (s + 1) % 2 are next written at step s + 3, after every rank has
     * published s + 2, so after this call. Kept as the last action, so a wait that ends at
     * the soft deadline is resumed here. */
    if (K > 0) {
        i = K - 1;
        while (i % FERRO_STREAM_RING >= FERRO_STREAM_RING / 2) i--;
        rc = ferro_split_wait(s, FERRO_PROG_OUT, i, deadline);
        if (rc != FERRO_OK) return rc;
    }
    return ferro_split_end(s);
}

/* A whole streamed all_gather of blocks of nbytes (called without the GIL): out = every rank's
 * block in rank order, this rank's own chunk by chunk right after each is published (read
 * again from the cache, not memory). */
static inline int ferro_stream_start(ferro_slots* s, const unsigned char* header, size_t hlen,
                                     uint64_t hash, uint32_t seq, const void* src,
                                     size_t nbytes, void* out, double deadline) {
    ferro_split* sp = &s->split;
    int rc = ferro_split_begin(s, header, hlen, hash, seq, deadline);
    sp->kind = FERRO_KIND_STREAM;
    sp->run = ferro_stream_run;
    sp->src = (const unsigned char*)src;
    sp->out = (unsigned char*)out;
    sp->itemsize = nbytes;  /* a block */
    sp->chunk = s->L.slot_bytes / (FERRO_STREAM_RING / 2);
    if (sp->chunk >= 64u) sp->chunk = sp->chunk / 64u * 64u;  /* whole cache lines */
    sp->nchunks = (int)((nbytes + sp->chunk - 1) / sp->chunk);
    ferro_put_choose(&s->put, nbytes * (size_t)s->n, 0);
    return ferro_split_go(s, rc, deadline);
}

#endif
