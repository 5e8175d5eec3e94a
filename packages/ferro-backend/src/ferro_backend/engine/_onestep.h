/* A one-call step's data: where it goes in every rank's slot (it moves on from call to call)
 * and how it comes out again (the fold, the broadcast and all_gather copies).
 *
 * On the slots of _slots.h (it reads them and s->rot, which ferro_slots_post, _steps.h, sets
 * for the step it posts).
 */
#ifndef FERRO_ONESTEP_H
#define FERRO_ONESTEP_H

#include <stddef.h>
#include <stdint.h>

#include "_slots.h"

/* Where a one-call step's data goes in every rank's slot: it moves on by its own size (in
 * pages) every call, through the whole slot, for calls of FERRO_ROTATE_MIN bytes per rank and
 * up. Writing the lines a peer read last call makes every store wait for that peer's copy to be
 * invalidated; lines it read a few calls ago have left its own cache. Measured (C, 2 threads on
 * this project's two-core VM, all_gather-style: copy in, flag, copy out; medians of 5
 * alternations): 8 KiB blocks 1.0 against 1.9 us, 32 KiB 3.1 against 6.9, 64 KiB 5.7 against
 * 13.8, 128 KiB 11.8 against 23.3; 4 KiB and less no faster (so they stay put). The offset is
 * the same on every rank: it follows the step number and the call's size per rank (span),
 * which the headers agree on before anyone reads. */
#define FERRO_ROTATE_MIN 8192u

/* a place: span bytes in whole pages */
static inline size_t ferro_slots_stride(size_t span) {
    return (span + 4095u) & ~(size_t)4095u;
}

/* the places a call of span bytes per rank moves through (1: it stays at the start) */
static inline size_t ferro_slots_places(const ferro_slots* s, size_t span) {
    size_t places;
    if (span < FERRO_ROTATE_MIN) return 1;  /* before the division: a span of 0 has no pages */
    places = s->L.slot_bytes / ferro_slots_stride(span);
    return places < 1 ? 1 : places;
}

/* where step's data starts (steps of one parity share a slot, so a place per two steps) */
static inline size_t ferro_slots_rot(const ferro_slots* s, uint32_t step, size_t span) {
    return (size_t)((step >> 1) % ferro_slots_places(s, span)) * ferro_slots_stride(span);
}

/* out = the rank-order fold of count items at byte offset of every rank's data of this step
 * (from s->rot); -1 for a dtype/op pair the kernel does not fold, or no memory. */
static inline int ferro_slots_fold(ferro_slots* s, void* out, size_t offset, ptrdiff_t count,
                                   int code, int op, double mean_divisor) {
    const void* few[64];
    const void** ptrs = few;
    int j, rc;
    if (s->n > 64) {
        ptrs = (const void**)malloc((size_t)s->n * sizeof(void*));
        if (ptrs == NULL) return -1;
    }
    for (j = 0; j < s->n; j++)
        ptrs[j] = ferro_slot_data(ferro_slots_slot(s, j, s->step)) + s->rot + offset;
    rc = ferro_fold(code, out, (const void* const*)ptrs, s->n, count, op, mean_divisor);
    if (ptrs != few) free(ptrs);
    return rc;
}

/* The part of ferro_slots_copy that comes from this rank's own src (nothing where it is a
 * broadcast's non-root or out already holds it): a caller may run it before the wait. */
static inline void ferro_slots_copy_own(ferro_slots* s, void* out_, const void* src,
                                        size_t nbytes, int root) {
    unsigned char* own = (unsigned char*)out_ + (root >= 0 ? 0 : (size_t)s->me * nbytes);
    if ((root < 0 || root == s->me) && own != (const unsigned char*)src)
        memcpy(own, src, nbytes);
}

/* The peers' part of it (what comes from their slots). */
static inline void ferro_slots_copy_peers(ferro_slots* s, void* out_, size_t nbytes, int root) {
    unsigned char* out = (unsigned char*)out_;
    int j;
    if (root >= 0) {
        if (root != s->me)
            memcpy(out, ferro_slot_data(ferro_slots_slot(s, root, s->step)) + s->rot, nbytes);
        return;
    }
    for (j = 0; j < s->n; j++)
        if (j != s->me)
            memcpy(out + (size_t)j * nbytes,
                   ferro_slot_data(ferro_slots_slot(s, j, s->step)) + s->rot, nbytes);
}

/* A broadcast (root >= 0: every rank copies nbytes from root's slot) or all_gather (root = -1:
 * block r of out from rank r's slot, this rank's own from src) of this step. */
static inline void ferro_slots_copy(ferro_slots* s, void* out, const void* src, size_t nbytes,
                                    int root) {
    ferro_slots_copy_own(s, out, src, nbytes, root);
    ferro_slots_copy_peers(s, out, nbytes, root);
}

#endif
