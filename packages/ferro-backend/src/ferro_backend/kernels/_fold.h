/* The reduction kernel: out = in[0] op in[1] op ... op in[count - 1], element-wise, in that
 * order, for every dtype and op of ferro/engine.h. The engine folds every rank's data with it
 * (rank order: every rank gets the same bits), and ferro-collective's point-to-point
 * algorithms fold pairs with it (ferro_backend.kernels._fold), so there is one definition of
 * what a reduction computes.
 *
 * - Floats: IEEE operations element by element, no reassociation and no fused multiply-add,
 *   so the bits equal numpy's ufuncs applied in the same order. MAX and MIN propagate NaN as
 *   np.maximum / np.minimum do. AVG (mean_divisor > 0) divides in the last step, fused with
 *   its add: ((in0 + in1) + in2) / d.
 * - float16 and bfloat16 are widened to float32 (exactly), folded there block by block, and
 *   rounded once to nearest-even, as numpy (float16) and ml_dtypes (bfloat16) round.
 * - Integers: SUM and PROD wrap (computed in unsigned arithmetic: no undefined overflow);
 *   BAND, BOR, BXOR; bool is folded as its bytes (0 or 1) with the bitwise ops.
 *
 * out may be the first or the second input, element for element (in place: the first pass
 * combines those two before any other is read), never a later one or shifted against one.
 * No Python, no allocation: callable from any thread.
 */
#ifndef FERRO_FOLD_H
#define FERRO_FOLD_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ferro/engine.h"
#include "_simd.h"

/* elements per block: a block of the output stays in the cache while every input is folded
 * into it */
#define FERRO_FOLD_BLOCK 4096
/* float16/bfloat16: elements widened at once (two float32 blocks on the stack) */
#define FERRO_FOLD_HALF_BLOCK 1024

/* bytes of one item of dtype (0: no such dtype) */
static inline size_t ferro_dtype_size(int dtype) {
    switch (dtype) {
    case FERRO_FLOAT64: case FERRO_INT64: case FERRO_UINT64: return 8;
    case FERRO_FLOAT32: case FERRO_INT32: case FERRO_UINT32: return 4;
    case FERRO_INT16: case FERRO_UINT16: case FERRO_FLOAT16: case FERRO_BFLOAT16: return 2;
    case FERRO_INT8: case FERRO_UINT8: case FERRO_BOOL: return 1;
    default: return 0;
    }
}

static inline int ferro_dtype_is_float(int dtype) {
    return dtype == FERRO_FLOAT32 || dtype == FERRO_FLOAT64 || dtype == FERRO_FLOAT16
        || dtype == FERRO_BFLOAT16;
}

/* Whether op reduces dtype: AVG floats only; the bitwise ops integers and bool; bool nothing
 * else. */
static inline int ferro_op_fits(int dtype, int op) {
    if (ferro_dtype_size(dtype) == 0 || op < 0 || op >= FERRO_OP_COUNT) return 0;
    if (op == FERRO_BAND || op == FERRO_BOR || op == FERRO_BXOR) return !ferro_dtype_is_float(dtype);
    if (dtype == FERRO_BOOL) return 0;
    if (op == FERRO_AVG) return ferro_dtype_is_float(dtype);
    return 1;
}

/* ---------------------------------------------------------------- half precision */
static inline float ferro_bits_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint32_t ferro_float_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

/* float16 -> float32, exact (NaN payloads kept) */
static inline float ferro_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    int shift = 0;
    if (e == 0x1Fu) return ferro_bits_float(sign | 0x7F800000u | (m << 13));
    if (e != 0u) return ferro_bits_float(sign | ((e + 112u) << 23) | (m << 13));
    if (m == 0u) return ferro_bits_float(sign);
    while (!(m & 0x400u)) {  /* a subnormal: normalize */
        m <<= 1;
        shift++;
    }
    return ferro_bits_float(sign | ((uint32_t)(113 - shift) << 23) | ((m & 0x3FFu) << 13));
}

/* float32 -> float16, rounded to nearest-even (overflow to infinity, NaN stays NaN with the
 * top of its payload), as numpy rounds */
static inline uint16_t ferro_float_to_half(float value) {
    uint32_t f = ferro_float_bits(value), f_exp = f & 0x7F800000u, f_sig = f & 0x007FFFFFu;
    uint16_t h_sgn = (uint16_t)((f & 0x80000000u) >> 16), h_sig, ret;
    if (f_exp >= 0x47800000u) {
        if (f_exp == 0x7F800000u && f_sig != 0u) {
            ret = (uint16_t)(0x7C00u + (f_sig >> 13));
            if (ret == 0x7C00u) ret++;
            return (uint16_t)(h_sgn + ret);
        }
        return (uint16_t)(h_sgn + 0x7C00u);
    }
    if (f_exp <= 0x38000000u) {
        if (f_exp < 0x33000000u) return h_sgn;
        f_exp >>= 23;
        f_sig = 0x00800000u + f_sig;
        f_sig >>= (113u - f_exp);
        if ((f_sig & 0x00003FFFu) != 0x00001000u || (f & 0x000007FFu)) f_sig += 0x00001000u;
        return (uint16_t)(h_sgn + (uint16_t)(f_sig >> 13));
    }
    if ((f_sig & 0x00003FFFu) != 0x00001000u) f_sig += 0x00001000u;
    h_sig = (uint16_t)(f_sig >> 13);
    return (uint16_t)(h_sgn + (uint16_t)(h_sig + (uint16_t)((f_exp - 0x38000000u) >> 13)));
}

static inline float ferro_bf16_to_float(uint16_t h) {
    return ferro_bits_float((uint32_t)h << 16);
}

/* float32 -> bfloat16, rounded to nearest-even; NaN becomes the quiet NaN of its sign, as
 * ml_dtypes rounds */
static inline uint16_t ferro_float_to_bf16(float value) {
    uint32_t f = ferro_float_bits(value);
    if ((f & 0x7F800000u) == 0x7F800000u && (f & 0x007FFFFFu) != 0u)
        return (uint16_t)((f >> 16) & 0x8000u) | 0x7FC0u;
    f += 0x7FFFu + ((f >> 16) & 1u);
    return (uint16_t)(f >> 16);
}

/* ---------------------------------------------------------------- the typed folds */
/* acc = acc op x and out = a op b for one type. U: the unsigned type SUM and PROD compute in
 * (at least unsigned int: no promotion to a signed int that could overflow). */
#define FERRO_INT_FOLD(T, U, SFX)                                                             \
    static void ferro_combine_##SFX(T* out, const T* a, const T* b, ptrdiff_t n, int op) {   \
        ptrdiff_t i;                                                                          \
        switch (op) {                                                                         \
        case FERRO_SUM: for (i = 0; i < n; i++) out[i] = (T)((U)a[i] + (U)b[i]); break;       \
        case FERRO_PROD: for (i = 0; i < n; i++) out[i] = (T)((U)a[i] * (U)b[i]); break;      \
        case FERRO_MAX: for (i = 0; i < n; i++) out[i] = a[i] >= b[i] ? a[i] : b[i]; break;   \
        case FERRO_MIN: for (i = 0; i < n; i++) out[i] = a[i] <= b[i] ? a[i] : b[i]; break;   \
        case FERRO_BAND: for (i = 0; i < n; i++) out[i] = (T)(a[i] & b[i]); break;            \
        case FERRO_BOR: for (i = 0; i < n; i++) out[i] = (T)(a[i] | b[i]); break;             \
        case FERRO_BXOR: for (i = 0; i < n; i++) out[i] = (T)(a[i] ^ b[i]); break;            \
        default: break;                                                                       \
        }                                                                                     \
    }                                                                                         \
    static void ferro_fold_##SFX(T* out, const void* const* in, ptrdiff_t count, ptrdiff_t n, \
                                 int op) {                                                    \
        ptrdiff_t start, size, j;                                                             \
        for (start = 0; start < n; start += FERRO_FOLD_BLOCK) {                               \
            size = n - start < FERRO_FOLD_BLOCK ? n - start : FERRO_FOLD_BLOCK;               \
            if (count >= 2)                                                                   \
                ferro_combine_##SFX(out + start, (const T*)in[0] + start,                     \
                                    (const T*)in[1] + start, size, op);                       \
            else if (out + start != (const T*)in[0] + start)                                  \
                memcpy(out + start, (const T*)in[0] + start, (size_t)size * sizeof(T));       \
            for (j = 2; j < count; j++)                                                       \
                ferro_combine_##SFX(out + start, out + start, (const T*)in[j] + start, size,  \
                                    op);                                                      \
        }                                                                                     \
    }

FERRO_INT_FOLD(int8_t, unsigned, i8)
FERRO_INT_FOLD(int16_t, unsigned, i16)
FERRO_INT_FOLD(int32_t, uint32_t, i32)
FERRO_INT_FOLD(int64_t, uint64_t, i64)
FERRO_INT_FOLD(uint8_t, unsigned, u8)
FERRO_INT_FOLD(uint16_t, unsigned, u16)
FERRO_INT_FOLD(uint32_t, uint32_t, u32)
FERRO_INT_FOLD(uint64_t, uint64_t, u64)

/* floats: d > 0 divides (AVG's last step). MAX/MIN: a NaN in either operand wins (the first
 * one's when both are NaN), as np.maximum / np.minimum. */
#define FERRO_FLOAT_FOLD(T, SFX)                                                              \
    static void ferro_combine_##SFX(T* out, const T* a, const T* b, ptrdiff_t n, int op,     \
                                    double d) {                                               \
        ptrdiff_t i;                                                                          \
        T x;                                                                                  \
        if (d > 0) {                                                                          \
            ferro_add3_div_##SFX(out, a, b, (T)d, n);                                         \
            return;                                                                           \
        }                                                                                     \
        switch (op) {                                                                         \
        case FERRO_SUM: case FERRO_AVG: ferro_add3_##SFX(out, a, b, n); break;                \
        case FERRO_PROD: for (i = 0; i < n; i++) out[i] = a[i] * b[i]; break;                 \
        case FERRO_MAX:                                                                       \
            for (i = 0; i < n; i++) {                                                         \
                x = a[i];                                                                     \
                if (!(x >= b[i]) && x == x) x = b[i];                                         \
                out[i] = x;                                                                   \
            }                                                                                 \
            break;                                                                            \
        case FERRO_MIN:                                                                       \
            for (i = 0; i < n; i++) {                                                         \
                x = a[i];                                                                     \
                if (!(x <= b[i]) && x == x) x = b[i];                                         \
                out[i] = x;                                                                   \
            }                                                                                 \
            break;                                                                            \
        default: break;                                                                       \
        }                                                                                     \
    }                                                                                         \
    static void ferro_fold_##SFX(T* out, const void* const* in, ptrdiff_t count, ptrdiff_t n, \
                                 int op, double d) {                                          \
        ptrdiff_t start, size, j;                                                             \
        for (start = 0; start < n; start += FERRO_FOLD_BLOCK) {                               \
            size = n - start < FERRO_FOLD_BLOCK ? n - start : FERRO_FOLD_BLOCK;               \
            if (count >= 2)                                                                   \
                ferro_combine_##SFX(out + start, (const T*)in[0] + start,                     \
                                    (const T*)in[1] + start, size, op, count == 2 ? d : 0.0); \
            else if (out + start != (const T*)in[0] + start)                                  \
                memcpy(out + start, (const T*)in[0] + start, (size_t)size * sizeof(T));       \
            for (j = 2; j < count; j++)                                                       \
                ferro_combine_##SFX(out + start, out + start, (const T*)in[j] + start, size,  \
                                    op, j == count - 1 ? d : 0.0);                            \
        }                                                                                     \
    }

FERRO_FLOAT_FOLD(float, f32)
FERRO_FLOAT_FOLD(double, f64)

/* float16 / bfloat16: widen a block of every input, fold in float32, round once */
#define FERRO_HALF_FOLD(SFX, WIDEN, ROUND)                                                    \
    static void ferro_fold_##SFX(uint16_t* out, const void* const* in, ptrdiff_t count,      \
                                 ptrdiff_t n, int op, double d) {                             \
        float acc[FERRO_FOLD_HALF_BLOCK], w[FERRO_FOLD_HALF_BLOCK];                           \
        ptrdiff_t start, size, i, j;                                                          \
        const uint16_t* x;                                                                    \
        for (start = 0; start < n; start += FERRO_FOLD_HALF_BLOCK) {                          \
            size = n - start < FERRO_FOLD_HALF_BLOCK ? n - start : FERRO_FOLD_HALF_BLOCK;     \
            x = (const uint16_t*)in[0] + start;                                               \
            for (i = 0; i < size; i++) acc[i] = WIDEN(x[i]);                                  \
            for (j = 1; j < count; j++) {                                                     \
                x = (const uint16_t*)in[j] + start;                                           \
                for (i = 0; i < size; i++) w[i] = WIDEN(x[i]);                                \
                ferro_combine_f32(acc, acc, w, size, op, j == count - 1 ? d : 0.0);           \
            }                                                                                 \
            for (i = 0; i < size; i++) out[start + i] = ROUND(acc[i]);                        \
        }                                                                                     \
    }

FERRO_HALF_FOLD(f16, ferro_half_to_float, ferro_float_to_half)
FERRO_HALF_FOLD(bf16, ferro_bf16_to_float, ferro_float_to_bf16)

/* out = the rank-order fold of count inputs of n items of dtype with op (the kernel op codes
 * are ferro_op's; AVG is a SUM whose last step divides by mean_divisor, which must be > 0;
 * mean_divisor > 0 divides with any float op). 0, or -1 for a dtype/op pair it does not fold. */
static inline int ferro_fold(int dtype, void* out, const void* const* in, ptrdiff_t count,
                             ptrdiff_t n, int op, double mean_divisor) {
    if (!ferro_op_fits(dtype, op) || count < 1 || n < 0) return -1;
    if (op == FERRO_AVG && !(mean_divisor > 0)) return -1;
    if (n == 0) return 0;
    switch (dtype) {
    case FERRO_FLOAT32: ferro_fold_f32((float*)out, in, count, n, op, mean_divisor); break;
    case FERRO_FLOAT64: ferro_fold_f64((double*)out, in, count, n, op, mean_divisor); break;
    case FERRO_FLOAT16: ferro_fold_f16((uint16_t*)out, in, count, n, op, mean_divisor); break;
    case FERRO_BFLOAT16: ferro_fold_bf16((uint16_t*)out, in, count, n, op, mean_divisor); break;
    case FERRO_INT8: ferro_fold_i8((int8_t*)out, in, count, n, op); break;
    case FERRO_INT16: ferro_fold_i16((int16_t*)out, in, count, n, op); break;
    case FERRO_INT32: ferro_fold_i32((int32_t*)out, in, count, n, op); break;
    case FERRO_INT64: ferro_fold_i64((int64_t*)out, in, count, n, op); break;
    case FERRO_UINT8: case FERRO_BOOL: ferro_fold_u8((uint8_t*)out, in, count, n, op); break;
    case FERRO_UINT16: ferro_fold_u16((uint16_t*)out, in, count, n, op); break;
    case FERRO_UINT32: ferro_fold_u32((uint32_t*)out, in, count, n, op); break;
    case FERRO_UINT64: ferro_fold_u64((uint64_t*)out, in, count, n, op); break;
    default: return -1;
    }
    return 0;
}

#endif
