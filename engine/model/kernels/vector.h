/* Small vector helpers that step.c and experts.c share: a horizontal sum, exp for 8 floats, the gated activations.
   Static and inline, so each file compiles its own copy with the same operations (a row's values do not depend on
   which file computed them). Written with AVX2 intrinsics, built for the instruction set simd.h selects. */
#ifndef STRATA_VECTOR_H
#define STRATA_VECTOR_H
#include <stdint.h>

#include "simd.h"

enum { SILU = 0, GELU_TANH = 1 };  /* the gate's activation: SwiGLU (Llama) or GeGLU with tanh's GELU (Gemma) */

KERNEL static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial for expf, 2^n
   by the exponent field; about 2 ulp; inputs below -88.37 give 0 (softmax's masked and far scores). */
KERNEL static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* out = act(gate) * up for the n values of a row's [gate | up]: SiLU, x / (1 + e^-x), or GELU with tanh,
   x / 2 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) with tanh(y) = 2 / (1 + e^-2y) - 1. */
KERNEL static inline void gated(const float *gate_up, int64_t n, int64_t activation, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate_up + i);
        __m256 a;
        if (activation == SILU) {
            a = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign))));
        } else {
            const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), _mm256_mul_ps(g, _mm256_mul_ps(g, g)))));
            const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), inner));
            const __m256 tanh = _mm256_sub_ps(_mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(one, e)), one);
            a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, tanh));
        }
        _mm256_storeu_ps(out + i, _mm256_mul_ps(a, _mm256_loadu_ps(gate_up + n + i)));
    }
}

#endif
