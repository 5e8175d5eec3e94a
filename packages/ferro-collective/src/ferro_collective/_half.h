/* _half.h: float32 <-> IEEE half (binary16) for the "fp16" wire format (_wire.pyx).
 *
 * Encoding rounds to nearest, ties to even (as numpy's astype(float16) and the F16C
 * instruction do); a value too large for a half becomes an infinity of its sign, a NaN a quiet
 * NaN of its sign with the top 10 bits of its payload (F16C's rule; numpy keeps a signalling
 * NaN signalling). Decoding is exact. Where the CPU has F16C (x86-64, checked at run time) eight
 * values go at a time through it; elsewhere, and for the tail, one at a time in plain C, which
 * gives the same bits for every input (a test compares the two over float32 bit patterns), so
 * ranks on different CPUs still agree. */
#ifndef FERRO_COLLECTIVE_HALF_H
#define FERRO_COLLECTIVE_HALF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t ferro_half_of(float x) {
    uint32_t f, exp, sig;
    uint16_t sign;
    memcpy(&f, &x, 4);
    sign = (uint16_t)((f >> 16) & 0x8000u);
    exp = f & 0x7f800000u;
    sig = f & 0x007fffffu;
    if (exp == 0x7f800000u)  /* inf, or a NaN made quiet */
        return (uint16_t)(sign | 0x7c00u | (sig ? 0x0200u | (sig >> 13) : 0u));
    if (exp >= 0x47800000u)  /* >= 65536: an infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (exp <= 0x38000000u) {  /* below the smallest normal half: a subnormal half, or 0 */
        uint32_t shift, kept, rest, half;
        if (exp < 0x33000000u) return sign;  /* below half the smallest subnormal: 0 */
        sig |= 0x00800000u;
        shift = 126u - (exp >> 23);          /* 14..24: to units of 2**-24 */
        kept = sig >> shift;
        rest = sig & ((1u << shift) - 1u);
        half = 1u << (shift - 1u);
        if (rest > half || (rest == half && (kept & 1u))) kept++;
        return (uint16_t)(sign | kept);      /* (a carry into the exponent is right) */
    }
    /* a normal half: drop 13 bits, rounding to nearest even (a carry may reach inf) */
    {
        uint32_t h = ((exp - 0x38000000u) >> 13) | (sig >> 13);
        uint32_t rest = sig & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
}

static inline float ferro_float_of_half(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, sig = h & 0x3ffu;
    uint32_t f;
    float x;
    if (exp == 0x1fu) {
        f = sign | 0x7f800000u | (sig ? 0x00400000u | (sig << 13) : 0u);
    } else if (exp != 0) {
        f = sign | ((exp + 112u) << 23) | (sig << 13);
    } else if (sig == 0) {
        f = sign;
    } else {  /* a subnormal half: sig * 2**-24, a normal float */
        x = (float)sig * 5.9604644775390625e-08f;
        memcpy(&f, &x, 4);
        f |= sign;
    }
    memcpy(&x, &f, 4);
    return x;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FERRO_HAVE_F16C_PATH 1

__attribute__((target("avx,f16c"))) static size_t ferro_half_encode_f16c(
        const float* x, uint16_t* out, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(void*)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    return i;
}

/* acc = fold(acc, q): op 0 copies, 1 adds (the other folds: one at a time, in _wire.pyx) */
__attribute__((target("avx,f16c"))) static size_t ferro_half_decode_f16c(
        const uint16_t* q, float* acc, size_t n, int op) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(const void*)(q + i)));
        _mm256_storeu_ps(acc + i, op == 0 ? v : _mm256_add_ps(_mm256_loadu_ps(acc + i), v));
    }
    return i;
}

static int ferro_half_f16c(void) {
    static int have = -1;
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
    }
    return have;
}
#else
#define FERRO_HAVE_F16C_PATH 0
static size_t ferro_half_encode_f16c(const float* x, uint16_t* out, size_t n) {
    (void)x; (void)out; (void)n;
    return 0;
}
static size_t ferro_half_decode_f16c(const uint16_t* q, float* acc, size_t n, int op) {
    (void)q; (void)acc; (void)n; (void)op;
    return 0;
}
static int ferro_half_f16c(void) { return 0; }
#endif

/* out[i] = x[i] as a half; `plain`: one at a time in C even where F16C is there */
static void ferro_half_encode(const float* x, uint16_t* out, size_t n, int plain) {
    size_t i = (!plain && ferro_half_f16c()) ? ferro_half_encode_f16c(x, out, n) : 0;
    for (; i < n; i++) out[i] = ferro_half_of(x[i]);
}

/* acc[i] = q[i] (op 0) or acc[i] + q[i] (op 1) as floats; returns how many it did (the
 * caller folds the rest, and every value for the other ops) */
static size_t ferro_half_decode(const uint16_t* q, float* acc, size_t n, int op, int plain) {
    size_t i;
    if (op != 0 && op != 1) return 0;
    i = (!plain && ferro_half_f16c()) ? ferro_half_decode_f16c(q, acc, n, op) : 0;
    for (; i < n; i++)
        acc[i] = op == 0 ? ferro_float_of_half(q[i]) : acc[i] + ferro_float_of_half(q[i]);
    return n;
}

#endif
