/* The reductions' hot loops for float32/float64 SUM (and AVG's fused divide), compiled twice:
 * for the x86-64 baseline (SSE2) and for AVX2, the one to run picked when the module loads
 * (GCC's target_clones, an ifunc). Where that is not available (another compiler or
 * architecture) they are plain loops the compiler vectorizes for its baseline.
 *
 * Element-wise IEEE operations only, no reassociation and no fused multiply-add (AVX2 alone
 * does not enable FMA), so both clones give the same bits as numpy and as each other.
 * out may alias a or b (the compiler checks overlap before it vectorizes).
 */
#ifndef FERRO_SIMD_H
#define FERRO_SIMD_H

#include <stddef.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FERRO_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FERRO_CLONES
#endif

#define FERRO_SIMD_LOOPS(T, SFX)                                                            \
    FERRO_CLONES static void ferro_add3_##SFX(T* out, const T* a, const T* b, ptrdiff_t n) { \
        ptrdiff_t i;                                                                        \
        for (i = 0; i < n; i++) out[i] = a[i] + b[i];                                       \
    }                                                                                       \
    FERRO_CLONES static void ferro_add3_div_##SFX(T* out, const T* a, const T* b, T d,      \
                                                   ptrdiff_t n) {                           \
        ptrdiff_t i;                                                                        \
        for (i = 0; i < n; i++) out[i] = (a[i] + b[i]) / d;                                 \
    }

FERRO_SIMD_LOOPS(float, f32)
FERRO_SIMD_LOOPS(double, f64)

/* whether the AVX2 clone runs here (for the benchmark's record and a test) */
static inline int ferro_simd_avx2(void) {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

#endif
