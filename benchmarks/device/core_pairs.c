/* Every pair of usable cores: a cache line's round trip between them (two threads, each bound
   to one core, handing a counter back and forth), ns per round trip, the median of 15 batches
   of 200. Prints a matrix (row i, column j), -1 on the diagonal. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <time.h>

static _Alignas(64) _Atomic long line;
static int cpu_b;
enum { BATCH = 200, BATCHES = 15 };

static void bind_to(int cpu) {
  cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s);
  pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static void *pong(void *arg) {
  (void)arg; bind_to(cpu_b);
  for (long k = 1; k <= (long)BATCH * (BATCHES + 1); k++) {
    while (atomic_load_explicit(&line, memory_order_acquire) != 2 * k - 1) {}
    atomic_store_explicit(&line, 2 * k, memory_order_release);
  }
  return 0;
}
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return (x > y) - (x < y); }

int main(void) {
  cpu_set_t all; sched_getaffinity(0, sizeof all, &all);
  int cpus[1024], n = 0;
  for (int c = 0; c < 1024; c++) if (CPU_ISSET(c, &all)) cpus[n++] = c;
  printf("cpus %d:", n); for (int i = 0; i < n; i++) printf(" %d", cpus[i]); printf("\n");
  for (int i = 0; i < n; i++) {
    for (int j = 0; j < n; j++) {
      if (i == j) { printf(" %6d", -1); continue; }
      if (j < i) { printf(" %6s", "."); continue; }
      atomic_store(&line, 0); cpu_b = cpus[j];
      pthread_t t; pthread_create(&t, 0, pong, 0); bind_to(cpus[i]);
      double b[BATCHES]; long k = 1;
      for (int r = 0; r < BATCHES + 1; r++) {
        double t0 = now();
        for (int m = 0; m < BATCH; m++, k++) {
          atomic_store_explicit(&line, 2 * k - 1, memory_order_release);
          while (atomic_load_explicit(&line, memory_order_acquire) != 2 * k) {}
        }
        if (r) b[r - 1] = (now() - t0) / BATCH;  /* the first batch warms up */
      }
      pthread_join(t, 0); qsort(b, BATCHES, sizeof b[0], cmp);
      printf(" %6.0f", b[BATCHES / 2]); fflush(stdout);
    }
    printf("\n");
  }
  return 0;
}
