/* Copies shared by the wire helpers (_wire.pyx) and the engine (_stream.h): one definition.
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

#endif
