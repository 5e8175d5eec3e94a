/* How a rank copies data into the shared segment (slots, rings): plain or streaming stores,
 * chosen per call. Included by _steps.h (ferro_slots holds a ferro_put). */
#ifndef FERRO_PUT_H
#define FERRO_PUT_H

#include <string.h>

#include "_copy.h"
#include "_sync.h"

typedef struct {               /* how this rank copies data into shared memory */
    size_t small_bytes;        /* calls of at most this many bytes always stream */
    double slow_ns;            /* plain copies slower than this (ns per KiB) count as slow */
    double ewma_ns;            /* plain copies into shared memory, ns per KiB, recent */
    unsigned calls;            /* large calls while slow (every FERRO_PUT_PROBE-th one: plain) */
    unsigned copies;           /* plain copies of FERRO_PUT_TIME_MIN up to FERRO_PUT_MIN bytes */
    int stream;                /* this call's choice */
} ferro_put;

/* Data into shared memory that a peer reads next (a slot, a ring), by a copy chosen per call
 * (ferro_put_choose): plain stores, or non-temporal ones, which invalidate the lines a peer
 * read last time without reading them for ownership first (the peer then reads the data from
 * memory instead of from this core's cache). Measured on this project's two-core VM, whose
 * cores' caches sometimes talk fast and sometimes (for minutes) four times slower, 2 ranks: a
 * plain copy of 32 KiB into lines the peer had read took 3.6 us or 14 us, a streaming one
 * 0.8-1.2 us either way; 64 KiB allreduce 10.8 / 37.9 us plain, 11.4 / 11.3 streaming; 1 MiB
 * 73 / 407-516 plain, 132-146 / 112-139 streaming. Those plain copies wrote the lines the peer
 * had read the call before; a call whose data moves on through the slot from call to call
 * (`moving`: ferro_slots_rot, the split's rings) writes lines the peer read calls ago, and
 * plain copies win there: 128 KiB all_gather blocks 11-18 us plain against 21-27 streaming,
 * the peer reading them from the cache instead of memory. So calls from FERRO_PUT_MIN up to
 * small_bytes stream unless moving (a smaller call's single copy stays plain: its latency is
 * the call's), and other calls stream only while plain copies into shared memory run slower
 * than slow_ns per KiB (calibrated at start: a multiple of a plain copy between two private
 * buffers), re-trying plain ones every FERRO_PUT_PROBE calls. A slow spell shows in the plain
 * copies' times (128 KiB: 45-53 us a copy instead of 3.4), so they are timed: every one from
 * FERRO_PUT_MIN bytes, every FERRO_PUT_SAMPLE-th from FERRO_PUT_TIME_MIN (a split's chunks;
 * the clock costs a tenth of such a copy). */
#define FERRO_PUT_MIN 16384u
#define FERRO_PUT_PROBE 64u
#define FERRO_PUT_TIME_MIN 4096u
#define FERRO_PUT_SAMPLE 8u

static inline void ferro_put_choose(ferro_put* p, size_t total, int moving) {
    p->stream = total >= FERRO_PUT_MIN && ((!moving && total <= p->small_bytes)
        || (p->ewma_ns > p->slow_ns && (++p->calls % FERRO_PUT_PROBE) != 0));
}

static inline void ferro_put_copy(ferro_put* p, unsigned char* dst, const unsigned char* src,
                                  size_t n) {
    double t0;
    if (p->stream) {
        ferro_stream_copy(dst, src, n);
    } else if (n < FERRO_PUT_TIME_MIN
               || (n < FERRO_PUT_MIN && ++p->copies % FERRO_PUT_SAMPLE != 0)) {  /* untimed */
        memcpy(dst, src, n);
    } else {
        t0 = ferro_now();
        memcpy(dst, src, n);
        p->ewma_ns = 0.75 * p->ewma_ns + 0.25 * (ferro_now() - t0) * 1e9 / ((double)n / 1024.0);
    }
}

#endif
