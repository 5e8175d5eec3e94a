/* The link probe: how fast this host moves data between the ranks' cores, measured as the
 * job forms (segment.py: Engine.join) and again whenever a caller asks (Engine.probe_link).
 *
 * Why: this project's two-core VM runs in two states, for seconds or minutes each, that the
 * kernel does not report (its cache topology reads the same in both): its two cores share a
 * cache, and a cache line goes from one to the other and back in about 40 ns, or they do not,
 * and the round trip takes about 100 ns; a 64 KiB copy written by one core and read by the
 * other takes 2.4 us in the first state and 10-34 us in the second (benchmarks/README.md,
 * "Where the ranks land"). Every copy between the ranks pays the state's price, so the
 * engine's results differ by state too; the probe tells which state a job is in.
 *
 * How: rank 0 and every other rank in turn play ping-pong on a word of their own control line
 * (ferro_ctrl.link): `rounds` round trips of that line, then `copies` rounds in which rank 0
 * writes `bytes` into its slot and the peer copies them out into a buffer of its own (the
 * lines go from rank 0's core to the peer's each round, as a collective's data does). Rank 0
 * keeps, per peer, the median round trip and the median copy round, and stamps the slowest
 * peer's in the segment's header before it says it is done; every rank then reads them.
 * The ranks spin (call it only while every rank has a core of its own: segment.py decides).
 * door.c runs it again, between two calls, when rank 0 asks for it (its copies slowed down or
 * sped up, or FERRO_SHM_REPROBE seconds passed): FERRO_REPROBE_* below.
 */
#ifndef FERRO_PROBE_H
#define FERRO_PROBE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_layout.h"
#include "_sync.h"

/* the most rounds of either kind (their times are kept to take the median) */
#define FERRO_PROBE_MAX_ROUNDS 1024
/* rank 0's word once the results are stamped */
#define FERRO_PROBE_DONE UINT64_MAX

/* wait until *w == v; FERRO_OK, or FERRO_TIMEOUT past the deadline, FERRO_FAILED when the
 * failure flag rises (both looked at every 1024 spins). Beyond FERRO_PROBE_SPIN spins it
 * yields the core every 256: two ranks not bound to cores of their own may find themselves
 * on one core for a while, where a pure spin would wait a whole time slice per round. */
#define FERRO_PROBE_SPIN 8192u
static inline int ferro_probe_wait(uint64_t* w, uint64_t v, double deadline,
                                   const uint32_t* failed) {
    unsigned k = 0;
    while (__atomic_load_n(w, __ATOMIC_ACQUIRE) != v) {
        ferro_pause();
        if (++k > FERRO_PROBE_SPIN && (k & 255u) == 0) sched_yield();
        if ((k & 1023u) == 0) {
            if (failed != NULL && ferro_load(failed)) return FERRO_FAILED;
            if (ferro_now() > deadline) return FERRO_TIMEOUT;
        }
    }
    return FERRO_OK;
}

static inline int ferro_probe_cmp(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

static inline double ferro_probe_median(double* t, int n) {
    qsort(t, (size_t)n, sizeof(double), ferro_probe_cmp);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

/* Rank 0's side with `peer` (its word's tag: the peer in the high half, the round in the low);
 * the median round trip and copy round (seconds) into rtt and copy. Round trips are timed in
 * batches of FERRO_PROBE_BATCH (a VM's clock may tick in tens of ns); copy rounds one by one. */
#define FERRO_PROBE_BATCH 8
static inline int ferro_probe_ping(unsigned char* base, const ferro_layout* L, int peer,
                                   int rounds, int copies, size_t bytes,
                                   const unsigned char* src, double deadline,
                                   const uint32_t* failed, double* times, double* rtt,
                                   double* copy) {
    uint64_t* mine = &ferro_ctrl_of(base, L, 0)->link;
    uint64_t* theirs = &ferro_ctrl_of(base, L, peer)->link;
    unsigned char* slot = ferro_slot_data(ferro_slot_of(base, L, 0, 0));
    uint64_t tag = (uint64_t)peer << 32;
    double t0 = ferro_now(), t;
    int i, rc, batches = 0;
    for (i = 1; i <= rounds + copies; i++) {
        if (i > rounds) memcpy(slot, src, bytes);
        __atomic_store_n(mine, tag | (uint64_t)i, __ATOMIC_RELEASE);
        if ((rc = ferro_probe_wait(theirs, (uint64_t)i, deadline, failed)) != FERRO_OK)
            return rc;
        if (i <= rounds && i % FERRO_PROBE_BATCH != 0 && i != rounds) continue;
        t = ferro_now();
        if (i <= rounds) {  /* a batch of round trips (the last one maybe shorter) */
            times[batches++] = (t - t0) / (double)(i % FERRO_PROBE_BATCH ? i % FERRO_PROBE_BATCH
                                                                          : FERRO_PROBE_BATCH);
            if (i == rounds) *rtt = ferro_probe_median(times, batches);
        } else {
            times[rounds + i - rounds - 1] = t - t0;
        }
        t0 = t;
    }
    *copy = ferro_probe_median(times + rounds, copies);
    return FERRO_OK;
}

/* a probe's round trips, copy rounds and copy bytes (at most a slot), the join's
 * (link.py, through _segment's defaults) and the door's re-probes alike */
#define FERRO_PROBE_ROUNDS 200
#define FERRO_PROBE_COPIES 16
#define FERRO_PROBE_BYTES 65536u
/* a re-probe sooner than FERRO_SHM_REPROBE seconds (but no sooner than this many after the
 * last) when rank 0's plain copies into shared memory (ferro_put's recent ns per KiB) moved
 * by this factor either way since the last probe */
#define FERRO_REPROBE_MIN_S 0.5
#define FERRO_REPROBE_FACTOR 2.0

static inline double ferro_wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Every rank calls it at once (rank: this rank). rtt_ns and copy_gbps: the slowest peer's
 * median round trip of a cache line, and its copy rounds' rate (bytes per round over the
 * median round). `scratch`: bytes of this rank's own memory. FERRO_OK, FERRO_TIMEOUT or
 * FERRO_FAILED (then nothing is stamped and the job's set-up fails). The words it uses read 0
 * when the segment's first probe starts; the probes of a segment are counted in its header
 * (rank 0 counts one before it says it is done, and the next probe's tags follow from it). */
static inline int ferro_probe_links(unsigned char* base, const ferro_layout* L, int rank,
                                    int rounds, int copies, size_t bytes,
                                    unsigned char* scratch, double deadline,
                                    const uint32_t* failed, double* rtt_ns, double* copy_gbps) {
    ferro_seg_head* head = ferro_head_of(base);
    uint64_t* zero = &ferro_ctrl_of(base, L, 0)->link;
    uint64_t* mine = &ferro_ctrl_of(base, L, rank)->link;
    uint64_t run = (uint64_t)__atomic_load_n(&head->probes, __ATOMIC_ACQUIRE) + 1u;
    uint64_t base_round = run * (uint64_t)(rounds + copies + 1), tag;
    unsigned char* slot = ferro_slot_data(ferro_slot_of(base, L, 0, 0));
    double times[2 * FERRO_PROBE_MAX_ROUNDS], rtt, copy, worst_rtt = 0, worst_copy = 0;
    int peer, i, rc;
    if (rounds < 1 || copies < 1 || rounds > FERRO_PROBE_MAX_ROUNDS
            || copies > FERRO_PROBE_MAX_ROUNDS || bytes == 0 || bytes > L->slot_bytes)
        return FERRO_INVALID;
    if (rank == 0) {
        for (peer = 1; peer < L->nranks; peer++) {
            /* (rounds counted on from the earlier runs': ferro_probe_ping's tags are 1..) */
            uint64_t* theirs = &ferro_ctrl_of(base, L, peer)->link;
            if ((rc = ferro_probe_wait(theirs, base_round, deadline, failed)) != FERRO_OK)
                return rc;  /* the peer is ready (its word at this run's start) */
            rc = ferro_probe_ping(base, L, peer, rounds, copies, bytes, scratch, deadline,
                                  failed, times, &rtt, &copy);
            if (rc != FERRO_OK) return rc;
            if (rtt > worst_rtt) worst_rtt = rtt;
            if (copy > worst_copy) worst_copy = copy;
        }
        head->link_rtt_ns = worst_rtt * 1e9;
        head->link_copy_gbps = worst_copy > 0 ? (double)bytes / worst_copy * 1e-9 : 0.0;
        head->link_at = ferro_wall_now();
        __atomic_store_n(&head->probes, (uint32_t)run, __ATOMIC_RELEASE);
        __atomic_store_n(zero, FERRO_PROBE_DONE, __ATOMIC_RELEASE);
    } else {
        __atomic_store_n(mine, base_round, __ATOMIC_RELEASE);  /* ready */
        tag = (uint64_t)rank << 32;
        for (i = 1; i <= rounds + copies; i++) {
            if ((rc = ferro_probe_wait(zero, tag | (uint64_t)i, deadline, failed)) != FERRO_OK)
                return rc;
            if (i > rounds) memcpy(scratch, slot, bytes);
            __atomic_store_n(mine, (uint64_t)i, __ATOMIC_RELEASE);
        }
        if ((rc = ferro_probe_wait(zero, FERRO_PROBE_DONE, deadline, failed)) != FERRO_OK)
            return rc;
    }
    *rtt_ns = head->link_rtt_ns;
    *copy_gbps = head->link_copy_gbps;
    return FERRO_OK;
}

#endif
