/* Atomics, the clock, futexes and the one wait loop of the same-host engine.
 *
 * Every kernel that waits on a word of the shared segment (a collective step, a ring's head or
 * tail, a doorbell) waits through ferro_wait: a bounded spin with a CPU pause; when the ranks
 * outnumber the cores (no spin), a bounded run of sched_yield, which hands the core to a peer
 * that needs it, for at most FERRO_YIELD_WINDOW seconds (on a host busy with other work, each
 * yield can give a whole time slice away: 1000 of them cost seconds); then a futex sleep that
 * the writer wakes. A sleep lasts at most FERRO_SLICE
 * seconds: across processes a dead peer never wakes anyone, so every slice re-checks the
 * deadline and this process's failure flag (raised when a peer dies, closes or aborts). The
 * words live in a MAP_SHARED mapping, so the futex calls are the shared (not _PRIVATE) ones.
 * Linux only: the engine is built on Linux alone.
 */
#ifndef FERRO_SYNC_H
#define FERRO_SYNC_H

#include <limits.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

#include "ferro/engine.h"

/* the longest a wait sleeps before it looks at its deadline and the failure flag again */
#define FERRO_SLICE 0.05
/* the longest a wait yields its core before it sleeps */
#define FERRO_YIELD_WINDOW 0.001

/* how a wait (or a collective step) ended: FERRO_OK, FERRO_TIMEOUT, FERRO_FAILED, or (a step)
 * FERRO_MISMATCH when the ranks' headers disagree: the door's statuses (ferro/engine.h) */
/* what a wait waits for: the word to differ from the target, or to reach it (mod 2**32) */
enum { FERRO_UNTIL_CHANGED = 0, FERRO_UNTIL_REACHED = 1 };

/* how a waiting rank spends its time before it sleeps */
typedef struct {
    int spin;    /* pause-spins first (0 when the ranks outnumber the cores) */
    int yields;  /* then sched_yield calls (only when spin is 0) */
} ferro_policy;

static inline uint32_t ferro_load(const uint32_t* p) {
    return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}
static inline void ferro_store(uint32_t* p, uint32_t v) {
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
}
static inline void ferro_add(uint32_t* p, int32_t v) {
    __atomic_fetch_add(p, (uint32_t)v, __ATOMIC_SEQ_CST);
}

static inline void ferro_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline double ferro_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A monotonic time a little after now, from the kernel's coarse clock: 3 ns a read here, where
 * CLOCK_MONOTONIC costs 25 ns on this VM's TSC (a fifth of a one-rank barrier through the door).
 * The coarse clock is the time of the last tick: 0.7-4.7 ms behind CLOCK_MONOTONIC here, with
 * ticks of 4 ms; two ticks added put it after now, by 3-7 ms. A call's deadline counts from it
 * (ferro_wait compares CLOCK_MONOTONIC with that deadline): never early, at most two ticks
 * late. Where the coarse tick is longer than 4 ms (or the clock is missing), CLOCK_MONOTONIC. */
#define FERRO_COARSE_TICK_MAX_NS 4000000
static inline double ferro_now_late(void) {
#ifdef CLOCK_MONOTONIC_COARSE
    static int64_t tick_ns = -1;  /* the coarse clock's tick, read once (0: not usable) */
    int64_t tick = __atomic_load_n(&tick_ns, __ATOMIC_RELAXED);
    struct timespec ts;
    if (tick < 0) {
        tick = clock_getres(CLOCK_MONOTONIC_COARSE, &ts) == 0 && ts.tv_sec == 0
            && ts.tv_nsec <= FERRO_COARSE_TICK_MAX_NS ? (int64_t)ts.tv_nsec : 0;
        __atomic_store_n(&tick_ns, tick, __ATOMIC_RELAXED);
    }
    if (tick > 0 && clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) == 0)
        return (double)ts.tv_sec + 1e-9 * (double)(ts.tv_nsec + 2 * tick);
#endif
    return ferro_now();
}

static inline void ferro_futex_wait(uint32_t* word, uint32_t seen, double seconds) {
    struct timespec ts;
    if (seconds < 0) seconds = 0;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0);
}

static inline void ferro_futex_wake(uint32_t* word) {
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Store v into *word and wake its sleepers, if it has any (no system call otherwise). */
static inline void ferro_publish(uint32_t* word, uint32_t v, const uint32_t* sleepers) {
    ferro_store(word, v);
    if (ferro_load(sleepers) != 0) ferro_futex_wake(word);
}

static inline int ferro_arrived(uint32_t value, uint32_t target, int mode) {
    return mode == FERRO_UNTIL_REACHED ? (int32_t)(value - target) >= 0 : value != target;
}

/* Wait until *word has changed from (or reached) target: FERRO_OK; FERRO_TIMEOUT at the
 * monotonic time deadline; FERRO_FAILED when failed (may be NULL) is raised. sleepers counts
 * this waiter while it sleeps (the writer wakes only counted sleepers); a waiter with a bell
 * rings it before each sleep (a producer telling its consumer it is about to sleep). Until
 * busy_until, a spinning waiter keeps spinning (the time its peer's copy should take). */
static inline int ferro_wait(const ferro_policy* pol, uint32_t* word, uint32_t target, int mode,
                             uint32_t* sleepers, double deadline, const uint32_t* failed,
                             uint32_t* bell, double busy_until) {
    int spins = 0, k;
    uint32_t seen;
    double now, slice, yield_until = 0.0;
    while (!ferro_arrived(ferro_load(word), target, mode)) {
        if (spins < pol->spin) {
            ferro_pause();
            spins++;
            continue;
        }
        now = ferro_now();  /* a wait that is already late times out, whatever else happened */
        if (now >= deadline) return FERRO_TIMEOUT;
        if (pol->spin && now < busy_until) {
            for (k = 0; k < 64; k++) ferro_pause();
            continue;
        }
        if (failed != NULL && ferro_load(failed) != 0) return FERRO_FAILED;
        if (spins < pol->spin + pol->yields) {
            if (yield_until == 0.0) yield_until = now + FERRO_YIELD_WINDOW;
            if (now < yield_until) {
                sched_yield();
                spins++;
                continue;
            }
            spins = pol->spin + pol->yields;  /* the window is over: sleep from now on */
        }
        ferro_add(sleepers, 1);
        seen = ferro_load(word);
        if (!ferro_arrived(seen, target, mode)) {
            if (bell != NULL) {
                ferro_add(bell, 1);
                ferro_futex_wake(bell);
            }
            slice = deadline - now;
            ferro_futex_wait(word, seen, slice < FERRO_SLICE ? slice : FERRO_SLICE);
        }
        ferro_add(sleepers, -1);
    }
    return FERRO_OK;
}

#endif
