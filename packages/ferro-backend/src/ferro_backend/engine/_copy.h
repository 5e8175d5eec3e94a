/* Copies shared by the wire helpers (_wire.pyx) and the engine (_steps.h): one definition.
 *
 * ferro_stream_copy copies with non-temporal stores where SSE2 is there (every x86-64): the
 * destination's lines are written without being read into the cache first (no
 * read-for-ownership), the right copy for blocks far larger than the cache that nobody reads
 * next. Elsewhere it is memcpy (FERRO_STREAM_STORES says which).
 */
#ifndef FERRO_COPY_H
#define FERRO_COPY_H

#include <stddef.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
static inline void ferro_stream_copy(unsigned char *dst, const unsigned char *src, size_t n) {
    size_t head = (16 - ((size_t)dst & 15)) & 15, i, blocks;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    blocks = n / 64;
    for (i = 0; i < blocks; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        src += 64; dst += 64;
    }
    memcpy(dst, src, n - blocks * 64);
    _mm_sfence();
}
static const int FERRO_STREAM_STORES = 1;
#else
static inline void ferro_stream_copy(unsigned char *dst, const unsigned char *src, size_t n) {
    memcpy(dst, src, n);
}
static const int FERRO_STREAM_STORES = 0;
#endif

/* ns per KiB of a plain copy of 64 KiB between two private buffers in the cache (best of 8): the
 * engine's yardstick for its copies into shared memory */
static inline double ferro_copy_ns_per_kib(double (*now)(void)) {
    static unsigned char a[65536], b[65536];
    double best = 1e30, t0, dt;
    int i;
    memset(a, 1, sizeof a);
    memset(b, 2, sizeof b);
    for (i = 0; i < 8; i++) {
        t0 = now();
        memcpy(b, a, sizeof a);
        __asm__ __volatile__("" : : "r"(b) : "memory");
        dt = now() - t0;
        if (dt < best) best = dt;
    }
    return best * 1e9 / 64.0;
}

#endif
