/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78; the iSCSI / ext4 / RFC 3720 checksum),
 * alone or fused with a copy: the bytes are loaded once, folded into the checksum and stored.
 *
 * Three implementations give the same bits:
 *  - x86-64 with SSE4.2 (picked at run time, __builtin_cpu_supports): the crc32 instruction on
 *    three interleaved streams (it has a latency of about 3 cycles and a throughput of one per
 *    cycle, so three independent streams keep it busy), their states joined by a shift table;
 *  - aarch64 with the CRC extension (ARMv8.1 and later have it, most ARMv8.0 cores too): the
 *    same structure with __crc32cd, always where the compiler targets it (__ARM_FEATURE_CRC32:
 *    Apple silicon, -march=armv8.1-a...), else on Linux when the kernel reports HWCAP_CRC32;
 *  - elsewhere, or when switched off for a test: table-driven, eight bytes a step.
 * Stores are plain, or non-temporal (movntdq, x86-64 only) for copies larger than the caches, so
 * the destination is not read in first.
 *
 * "state" below is the CRC register: crc32c(data) = ~update(~0, data). update() is linear in
 * (state, data), so update(s, A || B) = zeros(update(s, A), |B|) ^ update(0, B), where zeros(s, n)
 * is the state after n zero bytes: a linear map of s, applied with four 256-entry tables.
 */
#ifndef FERRO_CRC32C_H
#define FERRO_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define FERRO_CRC32C_POLY 0x82F63B78u
#define FERRO_CRC_LONG 8192 /* bytes per stream in a long 3-stream block */
#define FERRO_CRC_SHORT 256 /* and in a short one */

static uint32_t ferro_crc_table[8][256];            /* table k: a byte followed by k zero bytes */
static uint32_t ferro_crc_long[4][256], ferro_crc_short[4][256]; /* zeros(s, LONG / SHORT) */
static int ferro_crc_have_hw = 0;                   /* this CPU has the instruction */
static int ferro_crc_use_hw = 0;                    /* and it is in use (a test may switch it) */

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <emmintrin.h>
#include <nmmintrin.h>
#define FERRO_CRC_HW_X86 1
#define FERRO_CRC_HW_NAME "sse4.2"
#define FERRO_CRC_TARGET __attribute__((target("sse4.2")))
#define FERRO_CRC64(c, w) ((uint32_t)_mm_crc32_u64((c), (w)))
#define FERRO_CRC8(c, b) _mm_crc32_u8((c), (b))
#elif defined(__aarch64__) && (defined(__ARM_FEATURE_CRC32) || \
                                (defined(__linux__) && (defined(__GNUC__) || defined(__clang__))))
#include <arm_acle.h>
#define FERRO_CRC_HW_ARM 1
#define FERRO_CRC_HW_NAME "armv8-crc"
#ifdef __ARM_FEATURE_CRC32 /* the compiler targets it (Apple silicon, -march=armv8.1-a...) */
#define FERRO_CRC_TARGET
#else /* picked at run time: Linux says whether the CPU has it (HWCAP_CRC32) */
#include <sys/auxv.h>
#define FERRO_CRC_ARM_RUNTIME 1
#ifdef __clang__
#define FERRO_CRC_TARGET __attribute__((target("crc")))
#else
#define FERRO_CRC_TARGET __attribute__((target("+crc")))
#endif
#endif
#define FERRO_CRC64(c, w) __crc32cd((c), (w))
#define FERRO_CRC8(c, b) __crc32cb((c), (b))
#endif

static inline uint64_t ferro_load64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* ---------------------------------------------------------------- software (any CPU) */
static uint32_t ferro_crc_sw(uint32_t s, const uint8_t *p, size_t n) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w = ferro_load64(p) ^ s;
        s = ferro_crc_table[7][w & 0xff] ^ ferro_crc_table[6][(w >> 8) & 0xff] ^
            ferro_crc_table[5][(w >> 16) & 0xff] ^ ferro_crc_table[4][(w >> 24) & 0xff] ^
            ferro_crc_table[3][(w >> 32) & 0xff] ^ ferro_crc_table[2][(w >> 40) & 0xff] ^
            ferro_crc_table[1][(w >> 48) & 0xff] ^ ferro_crc_table[0][w >> 56];
    }
#endif
    while (n--) s = ferro_crc_table[0][(s ^ *p++) & 0xff] ^ (s >> 8);
    return s;
}

static inline uint32_t ferro_crc_shift(uint32_t t[4][256], uint32_t s) {
    return t[0][s & 0xff] ^ t[1][(s >> 8) & 0xff] ^ t[2][(s >> 16) & 0xff] ^ t[3][s >> 24];
}

/* the tables of zeros(., n): column j is zeros(1 << j, n), a table entry XORs its bits' columns */
static void ferro_crc_shift_table(uint32_t t[4][256], size_t n) {
    static const uint8_t zero[FERRO_CRC_LONG];
    uint32_t col[32];
    int j, k, b;
    for (j = 0; j < 32; j++) col[j] = ferro_crc_sw(1u << j, zero, n);
    for (k = 0; k < 4; k++)
        for (b = 0; b < 256; b++) {
            uint32_t v = 0;
            for (j = 0; j < 8; j++)
                if (b >> j & 1) v ^= col[8 * k + j];
            t[k][b] = v;
        }
}

/* ---------------------------------------------------------------- the instruction */
#ifdef FERRO_CRC_HW_NAME
/* one stream: the state after n bytes of src (copied to dst unless dst is NULL) */
FERRO_CRC_TARGET static uint32_t ferro_crc_hw1(uint32_t s, const uint8_t *src, uint8_t *dst,
                                              size_t n) {
    for (; n >= 8; src += 8, n -= 8) {
        uint64_t w = ferro_load64(src);
        s = FERRO_CRC64(s, w);
        if (dst) {
            memcpy(dst, &w, 8);
            dst += 8;
        }
    }
    for (; n; n--, src++) {
        s = FERRO_CRC8(s, *src);
        if (dst) *dst++ = *src;
    }
    return s;
}

/* Three streams of L bytes each (a block of 3L), then the states joined; STORE(d, w) stores a
 * word when copying (COPYING: 1 when dst is a destination to advance). Leaves src, n (and dst)
 * past the blocks done. */
#define FERRO_CRC_BLOCKS(L, TABLE, STORE, COPYING)                                         \
    while (n >= 3 * (size_t)(L)) {                                                          \
        uint32_t s1 = 0, s2 = 0;                                                            \
        size_t i;                                                                           \
        for (i = 0; i < (L); i += 8) {                                                      \
            uint64_t w0 = ferro_load64(src + i), w1 = ferro_load64(src + (L) + i);          \
            uint64_t w2 = ferro_load64(src + 2 * (L) + i);                                  \
            s = FERRO_CRC64(s, w0);                                                         \
            s1 = FERRO_CRC64(s1, w1);                                                       \
            s2 = FERRO_CRC64(s2, w2);                                                       \
            STORE(dst + i, w0);                                                             \
            STORE(dst + (L) + i, w1);                                                       \
            STORE(dst + 2 * (L) + i, w2);                                                   \
        }                                                                                   \
        s = ferro_crc_shift(TABLE, ferro_crc_shift(TABLE, s) ^ s1) ^ s2;                    \
        src += 3 * (size_t)(L);                                                             \
        if (COPYING) dst += 3 * (size_t)(L);                                                \
        n -= 3 * (size_t)(L);                                                               \
    }

#define FERRO_STORE_NONE(d, w) ((void)0)
#define FERRO_STORE_PLAIN(d, w) memcpy((d), &(w), 8)

FERRO_CRC_TARGET static uint32_t ferro_crc_hw(uint32_t s, const uint8_t *src, size_t n) {
    uint8_t *dst = NULL; /* never stored to nor advanced */
    FERRO_CRC_BLOCKS(FERRO_CRC_LONG, ferro_crc_long, FERRO_STORE_NONE, 0)
    FERRO_CRC_BLOCKS(FERRO_CRC_SHORT, ferro_crc_short, FERRO_STORE_NONE, 0)
    (void)dst;
    return ferro_crc_hw1(s, src, NULL, n);
}

FERRO_CRC_TARGET static uint32_t ferro_crc_hw_copy(uint32_t s, const uint8_t *src, uint8_t *dst,
                                                  size_t n) {
    FERRO_CRC_BLOCKS(FERRO_CRC_LONG, ferro_crc_long, FERRO_STORE_PLAIN, 1)
    FERRO_CRC_BLOCKS(FERRO_CRC_SHORT, ferro_crc_short, FERRO_STORE_PLAIN, 1)
    return ferro_crc_hw1(s, src, dst, n);
}

#ifdef FERRO_CRC_HW_X86
/* Whether a forward copy would load bytes whose address matches a store still in flight in its
 * low 12 bits ("4K aliasing": the load waits for the store, and a streamed store waits long).
 * That happens when dst - src is a little above a multiple of 4096; copying backward avoids
 * it (glibc's memmove does the same). */
static inline int ferro_aliases(const uint8_t *src, const uint8_t *dst) {
    size_t d = (size_t)((uintptr_t)dst - (uintptr_t)src) & 4095;
    return d != 0 && d < 1024;
}

/* memcpy from the end down, stored past the caches (for a destination that 4K-aliases) */
static void ferro_copy_back(uint8_t *dst, const uint8_t *src, size_t n) {
    size_t tail = (size_t)((uintptr_t)(dst + n) & 15);
    if (tail > n) tail = n;
    n -= tail;
    memcpy(dst + n, src + n, tail);
    while (n >= 64) { /* dst + n stays 16-byte aligned */
        n -= 64;
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(src + n + 48));
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + n + 32));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + n + 16));
        __m128i d = _mm_loadu_si128((const __m128i *)(const void *)(src + n));
        _mm_stream_si128((__m128i *)(void *)(dst + n + 48), a);
        _mm_stream_si128((__m128i *)(void *)(dst + n + 32), b);
        _mm_stream_si128((__m128i *)(void *)(dst + n + 16), c);
        _mm_stream_si128((__m128i *)(void *)(dst + n), d);
    }
    memcpy(dst, src, n);
}

/* three streams of 16-byte loads, each checksummed as two words and stored past the caches
 * (movntdq; 16-byte stores: 8-byte movnti in three streams is several times slower) */
FERRO_CRC_TARGET static uint32_t ferro_crc_hw_stream(uint32_t s, const uint8_t *src, uint8_t *dst,
                                                    size_t n) {
    const size_t L = FERRO_CRC_LONG;
    size_t i, head = (size_t)(-(uintptr_t)dst & 15); /* movntdq needs an aligned destination */
    if (ferro_aliases(src, dst)) { /* each block checksummed, then copied backward */
        for (; n >= 3 * L; src += 3 * L, dst += 3 * L, n -= 3 * L) {
            s = ferro_crc_hw(s, src, 3 * L);
            ferro_copy_back(dst, src, 3 * L);
        }
        _mm_sfence();
        return ferro_crc_hw_copy(s, src, dst, n);
    }
    if (head > n) head = n;
    s = ferro_crc_hw1(s, src, dst, head);
    src += head;
    dst += head;
    n -= head;
    for (; n >= 3 * L; src += 3 * L, dst += 3 * L, n -= 3 * L) {
        uint32_t s1 = 0, s2 = 0;
        for (i = 0; i < L; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + L + i));
            __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + 2 * L + i));
            s = FERRO_CRC64(s, ferro_load64(src + i));
            s1 = FERRO_CRC64(s1, ferro_load64(src + L + i));
            s2 = FERRO_CRC64(s2, ferro_load64(src + 2 * L + i));
            s = FERRO_CRC64(s, ferro_load64(src + i + 8));
            s1 = FERRO_CRC64(s1, ferro_load64(src + L + i + 8));
            s2 = FERRO_CRC64(s2, ferro_load64(src + 2 * L + i + 8));
            _mm_stream_si128((__m128i *)(void *)(dst + i), a);
            _mm_stream_si128((__m128i *)(void *)(dst + L + i), b);
            _mm_stream_si128((__m128i *)(void *)(dst + 2 * L + i), c);
        }
        s = ferro_crc_shift(ferro_crc_long, ferro_crc_shift(ferro_crc_long, s) ^ s1) ^ s2;
    }
    _mm_sfence(); /* the streamed stores are visible before anything after this call */
    return ferro_crc_hw_copy(s, src, dst, n);
}
#endif
#endif

/* ---------------------------------------------------------------- the interface */
/* once, before any other call (with the GIL held: it fills the tables) */
static void ferro_crc32c_init(void) {
    int b, k, j;
    for (b = 0; b < 256; b++) {
        uint32_t c = (uint32_t)b;
        for (j = 0; j < 8; j++) c = (c >> 1) ^ (FERRO_CRC32C_POLY & (0u - (c & 1u)));
        ferro_crc_table[0][b] = c;
    }
    for (k = 1; k < 8; k++)
        for (b = 0; b < 256; b++)
            ferro_crc_table[k][b] =
                (ferro_crc_table[k - 1][b] >> 8) ^ ferro_crc_table[0][ferro_crc_table[k - 1][b] & 0xff];
    ferro_crc_shift_table(ferro_crc_long, FERRO_CRC_LONG);
    ferro_crc_shift_table(ferro_crc_short, FERRO_CRC_SHORT);
#if defined(FERRO_CRC_HW_X86)
    __builtin_cpu_init();
    ferro_crc_have_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#elif defined(FERRO_CRC_ARM_RUNTIME)
    ferro_crc_have_hw = (getauxval(AT_HWCAP) & (1ul << 7)) ? 1 : 0; /* HWCAP_CRC32 */
#elif defined(FERRO_CRC_HW_ARM)
    ferro_crc_have_hw = 1;
#endif
    ferro_crc_use_hw = ferro_crc_have_hw;
}

/* "sse4.2", "armv8-crc" or "software": what ferro_crc32c_update runs now */
static const char *ferro_crc32c_impl(void) {
#ifdef FERRO_CRC_HW_NAME
    if (ferro_crc_use_hw) return FERRO_CRC_HW_NAME;
#endif
    return "software";
}

/* use the instruction (if the CPU has it) or the tables; returns whether it is in use */
static int ferro_crc32c_set_hw(int on) {
    ferro_crc_use_hw = on && ferro_crc_have_hw;
    return ferro_crc_use_hw;
}

/* the state after n bytes of src; with dst (not overlapping src), the bytes are copied there in
 * the same pass, streamed past the caches if `stream` */
static uint32_t ferro_crc32c_update(uint32_t s, const uint8_t *src, uint8_t *dst, size_t n,
                                    int stream) {
#ifdef FERRO_CRC_HW_NAME
    if (ferro_crc_use_hw) {
        if (!dst) return ferro_crc_hw(s, src, n);
#ifdef FERRO_CRC_HW_X86
        if (stream) return ferro_crc_hw_stream(s, src, dst, n);
#endif
        return ferro_crc_hw_copy(s, src, dst, n);
    }
#endif
    (void)stream;
    while (n) { /* copy a piece, then checksum it while it is in the cache */
        size_t k = n < 65536 ? n : 65536;
        if (dst) {
            memcpy(dst, src, k);
            dst += k;
        }
        s = ferro_crc_sw(s, src, k);
        src += k;
        n -= k;
    }
    return s;
}

/* memcpy(dst, src, n) for non-overlapping buffers; `stream` stores past the caches (x86-64) */
static void ferro_copy(uint8_t *dst, const uint8_t *src, size_t n, int stream) {
#ifdef FERRO_CRC_HW_X86
    if (stream && n >= 256 && ferro_aliases(src, dst)) {
        ferro_copy_back(dst, src, n);
        _mm_sfence();
        return;
    }
    if (stream && n >= 256) {
        size_t head = (size_t)(-(uintptr_t)dst & 15);
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        for (; n >= 64; dst += 64, src += 64, n -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(const void *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(const void *)(src + 48));
            _mm_stream_si128((__m128i *)(void *)dst, a);
            _mm_stream_si128((__m128i *)(void *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(void *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(void *)(dst + 48), d);
        }
        _mm_sfence();
    }
#else
    (void)stream;
#endif
    memcpy(dst, src, n);
}

#endif
