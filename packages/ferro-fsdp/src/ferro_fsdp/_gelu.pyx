# cython: language_level=3
"""GELU, ``x * Phi(x)``, and its derivative, exact (erf) and tanh-approximated, in loops without
the GIL that the C compiler vectorizes.

float32 is computed in float with branch-free polynomial ``exp`` and ``erf`` written below
(libm's scalar ``expf``/``erff`` calls would stop the vectorizer; numpy's float32 ``exp`` is
SIMD, so a scalar loop lost to it). float64 uses the same branch-free ``exp`` in double; the
exact forward keeps libm's double ``erf`` (correctly rounded to within an ulp, which the tests
hold it to), one element at a time. Selects instead of branches keep NaN, +-inf and signed
zeros as torch has them: ``GELU(-inf)`` is NaN (``-inf * 0``), ``GELU(+inf)`` is ``+inf``.

Validation lives in ``activations.py`` only: the arrays are 1-d, C-contiguous, of one dtype and
one length. The build passes ``-ffp-contract=off`` (no fused multiply-add: the polynomials are
rounded the same way wherever they run) and ``-fno-math-errno``.
"""

from cython cimport floating

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #include <math.h>

    /* The selects below compare floats; gcc if-converts (and so vectorizes) them only when
       it may assume no trapping floating-point: for this code only, not the whole build. */
    #if defined(__GNUC__) && !defined(__clang__)
    #pragma GCC push_options
    #pragma GCC optimize ("no-trapping-math")
    #endif

    /* Each loop is also built for AVX2 (8 floats / 4 doubles a vector, no FMA) and picked at
       load time where the CPU has it; the portable build stays SSE2. Without FMA both clones round
       every operation alike: the same bits either way. */
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__ELF__)
    #define FERRO_CLONES __attribute__((target_clones("avx2", "default")))
    #else
    #define FERRO_CLONES
    #endif

    /* exp(hi + lo) in float, |lo| << |hi|, ~2 ulp; 0 below -87.3 (GELU only needs arguments
       <= 0; above 88.7 it is +inf, no subnormal results). Cody-Waite
       reduction by ln 2 (the integer n from the 1.5 * 2^23 rounding trick), Cephes' degree-7
       polynomial on |r| <= ln2 / 2, 2^n built in the exponent bits: no branch, no libm call. */
    static inline float ferro_expf2(float hi, float lo) {
        const float shift = 12582912.0f;
        float xc = hi < -87.3f ? -87.3f : hi;
        xc = xc > 88.7f ? 88.7f : xc;
        float t = xc * 1.44269504088896341f + shift;
        float n = t - shift;
        uint32_t ti;
        memcpy(&ti, &t, 4);
        float r = xc - n * 0.693359375f;
        r = r - n * -2.12194440e-4f;
        r = r + lo;
        float p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = p * (r * r) + r + 1.0f;
        uint32_t bits = (ti - 0x4B400000u + 127u) << 23;
        float scale;
        memcpy(&scale, &bits, 4);
        float y = p * scale;
        y = hi < -87.3f ? 0.0f : y;
        y = hi > 88.7f ? INFINITY : y;
        return y;
    }

    /* exp(x) in double, ~1 ulp; 0 below -708 (no subnormal results), +inf above 709 (GELU only
       needs arguments <= 0): the same scheme, fdlibm's split of ln 2 and the Taylor polynomial
       to degree 13 (remainder < 1e-17 on |r| <= 0.347). */
    static inline double ferro_exp(double x) {
        const double shift = 6755399441055744.0;
        double xc = x < -708.0 ? -708.0 : x;
        xc = xc > 709.0 ? 709.0 : xc;
        double t = xc * 1.4426950408889634074 + shift;
        double n = t - shift;
        uint64_t ti;
        memcpy(&ti, &t, 8);
        double r = xc - n * 6.93147180369123816490e-01;
        r = r - n * 1.90821492927058770002e-10;
        double p = 1.0 / 6227020800.0;
        p = p * r + 1.0 / 479001600.0;
        p = p * r + 1.0 / 39916800.0;
        p = p * r + 1.0 / 3628800.0;
        p = p * r + 1.0 / 362880.0;
        p = p * r + 1.0 / 40320.0;
        p = p * r + 1.0 / 5040.0;
        p = p * r + 1.0 / 720.0;
        p = p * r + 1.0 / 120.0;
        p = p * r + 1.0 / 24.0;
        p = p * r + 1.0 / 6.0;
        p = p * r + 0.5;
        p = p * (r * r) + r + 1.0;
        uint64_t bits = (ti - 0x4338000000000000ull + 1023u) << 52;
        double scale;
        memcpy(&scale, &bits, 8);
        double y = p * scale;
        y = x < -708.0 ? 0.0 : y;
        y = x > 709.0 ? INFINITY : y;
        return y;
    }

    static inline float ferro_expf(float x) { return ferro_expf2(x, 0.0f); }

    /* x with the low 12 bits of its significand cleared: xh * xh is exact, and
       x^2 = xh * xh + (x - xh) (x + xh) to a few ulp of the small part */
    static inline float ferro_hi12f(float x) {
        uint32_t b;
        memcpy(&b, &x, 4);
        b &= 0xFFFFF000u;
        memcpy(&x, &b, 4);
        return x;
    }

    /* Phi(x) = 0.5 (1 + erf(x / sqrt 2)) in float, |error| <= ~1.5e-7 absolute, a few ulp
       relative in the lower tail (x >= -13; 0 below -14). |z| < 1: erf(z) = z P(z^2) (degree 6,
       fitted on Chebyshev nodes). |z| >= 1: erfc(t) = exp(-t^2) w Q(w - 0.5525), w = 1/t (Q of
       degree 9, fitted the same way to erfc(t) t exp(t^2) on t in [1, 9.5]), with
       t^2 = x^2 / 2 split exactly into hi + lo for the exponential. */
    static inline float ferro_cdff(float x) {
        float z = x * 0.70710678118654752f;
        float s = z * z;
        float p = 7.882497448008507e-05f;
        p = p * s + -0.0008018855005502701f;
        p = p * s + 0.005189312156289816f;
        p = p * s + -0.02685432881116867f;
        p = p * s + 0.11283597350120544f;
        p = p * s + -0.3761262595653534f;
        p = p * s + 1.1283791065216064f;
        float small = 0.5f + 0.5f * (z * p);
        float t = fabsf(z);
        float w = 1.0f / (t < 1.0f ? 1.0f : t);
        float v = w - 0.5525f;
        float q = -0.031772177666425705f;
        q = q * v + 0.08111251890659332f;
        q = q * v + -0.07134898006916046f;
        q = q * v + 0.012528827413916588f;
        q = q * v + 0.05112098902463913f;
        q = q * v + -0.09657005965709686f;
        q = q * v + 0.09735171496868134f;
        q = q * v + -0.019624575972557068f;
        q = q * v + -0.17013470828533173f;
        q = q * v + 0.5019282102584839f;
        /* t^2 = x^2 / 2 as hi + lo from x itself (x rounded to x / sqrt 2 would cost ~t^2 ulp) */
        float ax = fabsf(x);
        float xh = ferro_hi12f(ax);
        float xl = ax - xh;
        float half_erfc = 0.5f * ferro_expf2(-0.5f * (xh * xh), -0.5f * (xl * (ax + xh))) * (w * q);
        float large = z < 0.0f ? half_erfc : 1.0f - half_erfc;
        return t < 1.0f ? small : large;
    }

    FERRO_CLONES
    static void ferro_gelu_erf_fwd_f(const float *restrict x, float *restrict out,
                                     float *restrict cdf, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) {
            float xi = x[i];
            float c = ferro_cdff(xi);
            cdf[i] = c;
            out[i] = xi * c;
        }
    }

    /* libm's erf, one call an element (not vectorized): the tests hold the float64 forward
       to libm's erf within 4e-16 */
    static void ferro_gelu_erf_fwd_d(const double *restrict x, double *restrict out,
                                     double *restrict cdf, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) {
            double xi = x[i];
            double c = 0.5 * (1.0 + erf(xi * 0.70710678118654752440));
            cdf[i] = c;
            out[i] = xi * c;
        }
    }

    /* g (Phi(x) + x phi(x)) from the saved Phi(x); float: x^2 / 2 as hi + lo again, so that
       phi(x) keeps a few ulp relative in the tails */
    FERRO_CLONES
    static void ferro_gelu_erf_bwd_f(const float *restrict g, const float *restrict x,
                                     const float *restrict cdf, float *restrict out,
                                     Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) {
            float xi = x[i];
            float ax = fabsf(xi);
            float xh = ferro_hi12f(ax);
            float xl = ax - xh;
            float pdf = ferro_expf2(-0.5f * (xh * xh), -0.5f * (xl * (ax + xh)))
                        * 0.39894228040143267794f;
            out[i] = g[i] * (cdf[i] + xi * pdf);
        }
    }

    FERRO_CLONES
    static void ferro_gelu_erf_bwd_d(const double *restrict g, const double *restrict x,
                                     const double *restrict cdf, double *restrict out,
                                     Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) {
            double xi = x[i];
            double pdf = ferro_exp(-0.5 * xi * xi) * 0.39894228040143267794;
            out[i] = g[i] * (cdf[i] + xi * pdf);
        }
    }

    /* tanh approximation, u = sqrt(2/pi) (x + 0.044715 x^3), GELU = x s with
       s = (1 + tanh u) / 2 = 1 / (1 + e) for u >= 0 and e / (1 + e) below, e = exp(-2 |u|)
       (no cancellation in either tail). Derivative: s + 2 x s (1 - s) u', with
       s (1 - s) = e / (1 + e)^2 (ds), recomputed from x (one exp) rather than saved. */
    static inline float ferro_tanh_sf(float xi, float *ds) {
        float u = 0.7978845608028654f * (xi + 0.044715f * (xi * xi * xi));
        float e = ferro_expf(-2.0f * fabsf(u));
        float d = 1.0f / (1.0f + e);
        *ds = e * d * d;
        return u >= 0.0f ? d : e * d;
    }

    static inline double ferro_tanh_s(double xi, double *ds) {
        double u = 0.7978845608028654 * (xi + 0.044715 * (xi * xi * xi));
        double e = ferro_exp(-2.0 * fabs(u));
        double d = 1.0 / (1.0 + e);
        *ds = e * d * d;
        return u >= 0.0 ? d : e * d;
    }

    FERRO_CLONES
    static void ferro_gelu_tanh_fwd_f(const float *restrict x, float *restrict out,
                                      Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) {
            float xi = x[i];
            float ds;
            out[i] = xi * ferro_tanh_sf(xi, &ds);
        }
    }

    FERRO_CLONES
    static void ferro_gelu_tanh_fwd_d(const double *restrict x, double *restrict out,
                                      Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) {
            double xi = x[i];
            double ds;
            out[i] = xi * ferro_tanh_s(xi, &ds);
        }
    }

    FERRO_CLONES
    static void ferro_gelu_tanh_bwd_f(const float *restrict g, const float *restrict x,
                                      float *restrict out, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) {
            float xi = x[i];
            float ds;
            float s = ferro_tanh_sf(xi, &ds);
            float du = 0.7978845608028654f * (1.0f + 0.134145f * (xi * xi));
            out[i] = g[i] * (s + 2.0f * xi * ds * du);
        }
    }

    FERRO_CLONES
    static void ferro_gelu_tanh_bwd_d(const double *restrict g, const double *restrict x,
                                      double *restrict out, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) {
            double xi = x[i];
            double ds;
            double s = ferro_tanh_s(xi, &ds);
            double du = 0.7978845608028654 * (1.0 + 0.134145 * (xi * xi));
            out[i] = g[i] * (s + 2.0 * xi * ds * du);
        }
    }

    #if defined(__GNUC__) && !defined(__clang__)
    #pragma GCC pop_options
    #endif
    """
    void ferro_gelu_erf_fwd_f(const float* x, float* out, float* cdf, Py_ssize_t n) nogil
    void ferro_gelu_erf_fwd_d(const double* x, double* out, double* cdf, Py_ssize_t n) nogil
    void ferro_gelu_erf_bwd_f(const float* g, const float* x, const float* cdf, float* out,
                              Py_ssize_t n) nogil
    void ferro_gelu_erf_bwd_d(const double* g, const double* x, const double* cdf,
                              double* out, Py_ssize_t n) nogil
    void ferro_gelu_tanh_fwd_f(const float* x, float* out, Py_ssize_t n) nogil
    void ferro_gelu_tanh_fwd_d(const double* x, double* out, Py_ssize_t n) nogil
    void ferro_gelu_tanh_bwd_f(const float* g, const float* x, float* out, Py_ssize_t n) nogil
    void ferro_gelu_tanh_bwd_d(const double* g, const double* x, double* out,
                               Py_ssize_t n) nogil


def gelu_forward(const floating[::1] x, floating[::1] out, floating[::1] cdf):
    """``out = x * Phi(x)`` and ``cdf = Phi(x)`` (kept for the backward)."""
    cdef Py_ssize_t n = x.shape[0]
    if n == 0:
        return
    with nogil:
        if floating is float:
            ferro_gelu_erf_fwd_f(&x[0], &out[0], &cdf[0], n)
        else:
            ferro_gelu_erf_fwd_d(&x[0], &out[0], &cdf[0], n)


def gelu_backward(const floating[::1] grad_output, const floating[::1] x,
                  const floating[::1] cdf, floating[::1] out):
    """``out = grad_output * (Phi(x) + x * phi(x))``."""
    cdef Py_ssize_t n = x.shape[0]
    if n == 0:
        return
    with nogil:
        if floating is float:
            ferro_gelu_erf_bwd_f(&grad_output[0], &x[0], &cdf[0], &out[0], n)
        else:
            ferro_gelu_erf_bwd_d(&grad_output[0], &x[0], &cdf[0], &out[0], n)


def gelu_tanh_forward(const floating[::1] x, floating[::1] out):
    """``out = x * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2`` (torch's ``approximate="tanh"``)."""
    cdef Py_ssize_t n = x.shape[0]
    if n == 0:
        return
    with nogil:
        if floating is float:
            ferro_gelu_tanh_fwd_f(&x[0], &out[0], n)
        else:
            ferro_gelu_tanh_fwd_d(&x[0], &out[0], n)


def gelu_tanh_backward(const floating[::1] grad_output, const floating[::1] x,
                       floating[::1] out):
    """``out = grad_output * d/dx`` of :func:`gelu_tanh_forward`, from ``x`` alone."""
    cdef Py_ssize_t n = x.shape[0]
    if n == 0:
        return
    with nogil:
        if floating is float:
            ferro_gelu_tanh_bwd_f(&grad_output[0], &x[0], &out[0], n)
        else:
            ferro_gelu_tanh_bwd_d(&grad_output[0], &x[0], &out[0], n)
