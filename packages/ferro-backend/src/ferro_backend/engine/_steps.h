/* The engine's collective steps: a step's two halves (post: header and data into this rank's
 * slot, published; meet: every rank's arrived, headers compared) and the exchange and sync built
 * on them, on the slots of _slots.h and the one-call data placement of _onestep.h. The split
 * reduction (_split.h) and the streamed all_gather (_stream.h) build on these; _door.h takes all
 * of them. Callers validate sizes; these functions trust them. No Python: callable from any
 * thread.
 */
#ifndef FERRO_STEPS_H
#define FERRO_STEPS_H

#include <stddef.h>
#include <stdint.h>

#include "_onestep.h"
#include "_slots.h"
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

/* The posted step's second half: wait for every rank until deadline, compare headers. */
static inline int ferro_slots_meet(ferro_slots* s, double deadline) {
    int rc = ferro_slots_wait_all(s, s->step, deadline);
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
    return ferro_slots_meet(s, deadline);
}

/* A step without slot writes (every rank has finished the last one). */
static inline int ferro_slots_sync(ferro_slots* s, double deadline) {
    s->step += 1;
    s->rot = 0;
    ferro_slots_publish(s, s->step);
    return ferro_slots_wait_all(s, s->step, deadline);
}

#endif
