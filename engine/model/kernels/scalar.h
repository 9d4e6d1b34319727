/* The AVX2, FMA and F16C intrinsics the kernels use, in C, for the generic build (simd.h).

   Each is its instruction's documented operation, lane by lane: IEEE single-precision adds, multiplies and
   divides (the same bits on every IEEE machine), a multiply-add rounded once, conversions rounded to nearest even
   as the instructions round in the default mode, integer lanes that wrap or saturate as theirs do. A kernel
   written with them therefore computes the same bits here as with the real instructions, in the same order:
   tests/test_native_kernels.py runs the generic and the vector builds on the same inputs and compares them.
   The names are Intel's so that one kernel text serves both builds. The vector types are GCC's and clang's vector
   extensions, which the compiler lowers to whatever the baseline has (two SSE2 registers for a 256-bit value on
   x86-64, NEON on ARM64) and to plain scalar code elsewhere; the operations on them are the lane-wise C
   operations, whose results no lowering may change (the tests hold every build to the same bits, which is how
   a fused multiply-add on vectors of doubles that GCC 12's SLP vectoriser computed otherwise was caught). */
#ifndef STRATA_SCALAR_H
#define STRATA_SCALAR_H
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int16_t v16s __attribute__((vector_size(32)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef int8_t v16c __attribute__((vector_size(16)));
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint64_t v4q __attribute__((vector_size(32)));
typedef uint64_t v2q __attribute__((vector_size(16)));

typedef v8f __m256;
typedef v4f __m128;
typedef v4q __m256i;
typedef v2q __m128i;

#define _MM_HINT_T0 3
#define _MM_FROUND_TO_NEAREST_INT 0x00
#define _MM_FROUND_NO_EXC 0x08
#define _mm_prefetch(p, hint) __builtin_prefetch((p), 0, (hint))

/* a * b + c rounded once. Where the baseline has the instruction (ARM64) it is one. Elsewhere the product is
   exact in double (24 + 24 bits), the sum's rounding error is recovered exactly (TwoSum), and an inexact sum is
   rounded to odd (its last bit set, towards the error) before the one rounding to float, which makes that
   rounding the correct one (a double carries more than 24 + 2 bits). Checked against the FMA instruction on
   2 x 10^8 operands, cancellations and subnormal results among them. Plain scalar code, lane by lane: a version
   on vectors of doubles was no faster here, and one of its forms came out of GCC 12's SLP vectoriser computing
   other bits. Not the C library's fmaf: its speed, and on some C runtimes its correctness, vary. */
static inline float fused1(float a, float b, float c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
    return __builtin_fmaf(a, b, c);
#else
    const double p = (double)a * (double)b;
    double s = p + (double)c;
    const double back = s - p, error = (p - (s - back)) + ((double)c - back);
    uint64_t bits;
    memcpy(&bits, &s, 8);
    if (error == error && error != 0.0 && !(bits & 1)) {  /* inexact and even: the odd neighbour towards the error */
        bits += (error > 0) == (s > 0) ? 1 : (uint64_t)-1;
        memcpy(&s, &bits, 8);
    }
    return (float)s;
#endif
}

static inline v8f fused(v8f a, v8f b, v8f c) {
    for (int i = 0; i < 8; i++) a[i] = fused1(a[i], b[i], c[i]);
    return a;
}

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* A float16 as float (exact), as VCVTPH2PS converts it: subnormals normalised, a NaN quieted. */
static inline float _cvtsh_ss(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F;
    uint32_t m = h & 0x3FF;
    if (e == 0x1F) return float_of(sign | 0x7F800000u | (m << 13) | (m ? 0x400000u : 0));
    if (e) return float_of(sign | ((e + 112) << 23) | (m << 13));
    if (!m) return float_of(sign);
    uint32_t exponent = 113;
    while (!(m & 0x400)) { m <<= 1; exponent--; }
    return float_of(sign | (exponent << 23) | ((m & 0x3FF) << 13));
}

/* A float as float16 rounded to nearest even, as VCVTPS2PH does with rounding 0 (overflow to infinity, a NaN
   quieted with the top of its payload). */
static inline uint16_t _cvtss_sh(float f, int rounding) {
    (void)rounding;  /* the kernels ask for nearest even only */
    const uint32_t x = bits_of(f), abs = x & 0x7FFFFFFFu;
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    if (abs > 0x7F800000u) return (uint16_t)(sign | 0x7E00 | ((abs >> 13) & 0x3FF));
    if (abs >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);  /* 65520 and up round to infinity */
    if (abs <= 0x33000000u) return sign;                        /* up to 2^-25 rounds to zero */
    if (abs < 0x38800000u) {                                     /* below 2^-14: a subnormal float16 */
        const uint32_t m = (abs & 0x7FFFFF) | 0x800000, shift = 126 - (abs >> 23);
        const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        uint32_t q = m >> shift;
        q += rest > half || (rest == half && (q & 1));
        return (uint16_t)(sign | q);
    }
    uint32_t q = (abs >> 13) - (112u << 10);
    const uint32_t rest = abs & 0x1FFF;
    q += rest > 0x1000 || (rest == 0x1000 && (q & 1));  /* a carry moves into the exponent, as it should */
    return (uint16_t)(sign | q);
}

/* float -> int32 rounded (VCVTPS2DQ, nearest even in the default mode) or truncated (VCVTTPS2DQ); out of range
   and NaN give INT32_MIN, as the instructions do. */
static inline int32_t rounded_int(float v) {
    return v >= -2147483648.0f && v < 2147483648.0f ? (int32_t)__builtin_nearbyintf(v) : INT32_MIN;
}
static inline int32_t truncated_int(float v) {
    return v >= -2147483648.0f && v < 2147483648.0f ? (int32_t)v : INT32_MIN;
}
static inline int16_t saturated16(int32_t v) { return (int16_t)(v > 32767 ? 32767 : v < -32768 ? -32768 : v); }

#define LANES(n, expr) for (int i = 0; i < (n); i++) expr

/* 8 floats */
static inline __m256 _mm256_setzero_ps(void) { return (v8f){0}; }
static inline __m256 _mm256_set1_ps(float v) { return (v8f){v, v, v, v, v, v, v, v}; }
static inline __m256 _mm256_loadu_ps(const float *p) { __m256 r; memcpy(&r, p, 32); return r; }
static inline void _mm256_storeu_ps(float *p, __m256 v) { memcpy(p, &v, 32); }
static inline __m256 _mm256_add_ps(__m256 a, __m256 b) { return a + b; }
static inline __m256 _mm256_sub_ps(__m256 a, __m256 b) { return a - b; }
static inline __m256 _mm256_mul_ps(__m256 a, __m256 b) { return a * b; }
static inline __m256 _mm256_div_ps(__m256 a, __m256 b) { return a / b; }
static inline __m256 _mm256_fmadd_ps(__m256 a, __m256 b, __m256 c) { return fused(a, b, c); }
static inline __m256 _mm256_fnmadd_ps(__m256 a, __m256 b, __m256 c) { return fused(-a, b, c); }
/* MAXPS / MINPS: the first operand where it is strictly larger (smaller), else the second (so a NaN gives it) */
static inline __m256 _mm256_max_ps(__m256 a, __m256 b) { const v8i m = a > b; return (v8f)((m & (v8i)a) | (~m & (v8i)b)); }
static inline __m256 _mm256_min_ps(__m256 a, __m256 b) { const v8i m = a < b; return (v8f)((m & (v8i)a) | (~m & (v8i)b)); }
static inline __m256 _mm256_floor_ps(__m256 a) { LANES(8, a[i] = __builtin_floorf(a[i])); return a; }
static inline __m256 _mm256_xor_ps(__m256 a, __m256 b) { return (v8f)((v8i)a ^ (v8i)b); }
static inline __m256 _mm256_andnot_ps(__m256 a, __m256 b) { return (v8f)(~(v8i)a & (v8i)b); }
static inline __m256 _mm256_permutevar8x32_ps(__m256 a, __m256i index) {
    const v8u k = (v8u)index;
    __m256 r;
    LANES(8, r[i] = a[k[i] & 7]);
    return r;
}
static inline __m256 _mm256_cvtepi32_ps(__m256i a) { return __builtin_convertvector((v8i)a, v8f); }
static inline __m256i _mm256_cvtps_epi32(__m256 a) { v8i r; LANES(8, r[i] = rounded_int(a[i])); return (__m256i)r; }
static inline __m256i _mm256_cvttps_epi32(__m256 a) { v8i r; LANES(8, r[i] = truncated_int(a[i])); return (__m256i)r; }
static inline __m256 _mm256_castsi256_ps(__m256i a) { return (v8f)a; }
static inline __m256 _mm256_cvtph_ps(__m128i h) { const v8h x = (v8h)h; __m256 r; LANES(8, r[i] = _cvtsh_ss(x[i])); return r; }
static inline __m128i _mm256_cvtps_ph(__m256 a, int rounding) {
    v8h r;
    LANES(8, r[i] = _cvtss_sh(a[i], rounding));
    return (__m128i)r;
}

/* 4 floats */
static inline __m128 _mm256_castps256_ps128(__m256 a) { __m128 r; memcpy(&r, &a, 16); return r; }
static inline __m128 _mm256_extractf128_ps(__m256 a, int half) { __m128 r; memcpy(&r, (char *)&a + 16 * (half & 1), 16); return r; }
static inline __m128 _mm_add_ps(__m128 a, __m128 b) { return a + b; }
static inline __m128 _mm_max_ps(__m128 a, __m128 b) {
    const v4f m = (v4f)(a > b);
    return (v4f)(((v2q)m & (v2q)a) | (~(v2q)m & (v2q)b));
}
static inline __m128 _mm_add_ss(__m128 a, __m128 b) { a[0] = a[0] + b[0]; return a; }
static inline __m128 _mm_max_ss(__m128 a, __m128 b) { a[0] = a[0] > b[0] ? a[0] : b[0]; return a; }
static inline __m128 _mm_movehl_ps(__m128 a, __m128 b) { a[0] = b[2]; a[1] = b[3]; return a; }
static inline __m128 _mm_movehdup_ps(__m128 a) { a[0] = a[1]; a[2] = a[3]; return a; }
static inline float _mm_cvtss_f32(__m128 a) { return a[0]; }

/* integers */
static inline __m128i _mm_loadu_si128(const __m128i *p) { __m128i r; memcpy(&r, p, 16); return r; }
static inline void _mm_storeu_si128(__m128i *p, __m128i v) { memcpy(p, &v, 16); }
static inline __m128i _mm_cvtsi64_si128(long long v) { return (v2q){(uint64_t)v, 0}; }
static inline __m256i _mm256_loadu_si256(const __m256i *p) { __m256i r; memcpy(&r, p, 32); return r; }
static inline void _mm256_storeu_si256(__m256i *p, __m256i v) { memcpy(p, &v, 32); }
static inline __m256i _mm256_set1_epi16(short v) { return (__m256i)((v16s){0} + v); }
static inline __m256i _mm256_set1_epi32(int v) { return (__m256i)((v8i){0} + v); }
static inline __m256i _mm256_and_si256(__m256i a, __m256i b) { return a & b; }
static inline __m256i _mm256_or_si256(__m256i a, __m256i b) { return a | b; }
static inline __m256i _mm256_add_epi32(__m256i a, __m256i b) { return (__m256i)((v8u)a + (v8u)b); }
static inline __m256i _mm256_sub_epi16(__m256i a, __m256i b) { return (__m256i)((v16h)a - (v16h)b); }
static inline __m256i _mm256_mullo_epi16(__m256i a, __m256i b) { return (__m256i)((v16h)a * (v16h)b); }
static inline __m256i _mm256_srli_epi16(__m256i a, int n) { return n > 15 ? (__m256i){0} : (__m256i)((v16h)a >> n); }
static inline __m256i _mm256_slli_epi16(__m256i a, int n) { return n > 15 ? (__m256i){0} : (__m256i)((v16h)a << n); }
static inline __m256i _mm256_slli_epi32(__m256i a, int n) { return n > 31 ? (__m256i){0} : (__m256i)((v8u)a << n); }
/* VPMADDWD: pairs of int16 products summed in int32 (only -32768 * -32768 twice wraps, as in the instruction).
   x86-64's baseline has it for 128 bits (SSE2's PMADDWD, the same operation per half): int32 multiplies, which
   SSE2 lacks, cost several times more. */
static inline __m256i _mm256_madd_epi16(__m256i a, __m256i b) {
#if defined(__SSE2__)
    typedef short v8s_ __attribute__((vector_size(16)));
    typedef int v4i_ __attribute__((vector_size(16)));
    v8s_ x[2], y[2];
    v4i_ r[2];
    memcpy(x, &a, 32);
    memcpy(y, &b, 32);
    r[0] = __builtin_ia32_pmaddwd128(x[0], y[0]);
    r[1] = __builtin_ia32_pmaddwd128(x[1], y[1]);
    __m256i out;
    memcpy(&out, r, 32);
    return out;
#else
    const v16i p = __builtin_convertvector((v16s)a, v16i) * __builtin_convertvector((v16s)b, v16i);
    v8u r;
    for (int i = 0; i < 8; i++) r[i] = (uint32_t)p[2 * i] + (uint32_t)p[2 * i + 1];
    return (__m256i)r;
#endif
}
/* VPACKSSDW: per 128-bit half, a's 4 int32 then b's 4, saturated to int16 */
static inline __m256i _mm256_packs_epi32(__m256i a, __m256i b) {
    const v8i x = (v8i)a, y = (v8i)b;
    v16s r;
    for (int half = 0; half < 2; half++)
        for (int i = 0; i < 4; i++) {
            r[8 * half + i] = saturated16(x[4 * half + i]);
            r[8 * half + 4 + i] = saturated16(y[4 * half + i]);
        }
    return (__m256i)r;
}
static inline __m256i _mm256_permute4x64_epi64(__m256i a, int order) { __m256i r; LANES(4, r[i] = a[(order >> (2 * i)) & 3]); return r; }
static inline __m256i _mm256_cvtepu8_epi16(__m128i a) { return (__m256i)__builtin_convertvector((v16b)a, v16h); }
static inline __m256i _mm256_cvtepi8_epi16(__m128i a) { return (__m256i)__builtin_convertvector((v16c)a, v16s); }
static inline __m256i _mm256_cvtepu8_epi32(__m128i a) { v8b low; memcpy(&low, &a, 8); return (__m256i)__builtin_convertvector(low, v8u); }
static inline __m256i _mm256_cvtepu16_epi32(__m128i a) { return (__m256i)__builtin_convertvector((v8h)a, v8u); }

#undef LANES
#endif
