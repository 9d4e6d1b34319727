/* The products of blocks.c that step.c and experts.c call (their descriptions are in blocks.c). */
#ifndef STRATA_BLOCKS_H
#define STRATA_BLOCKS_H
#include <stdint.h>

/* The library's entry points, the only symbols it exports (build.py compiles with -fvisibility=hidden). */
#ifdef _WIN32
#define EXPORT __declspec(dllexport)
#else
#define EXPORT __attribute__((visibility("default")))
#endif

/* out [M, N] = x [M, K] @ w.T for w as 4-bit (q4), 8-bit (q8), Q4_K (q4k), Q6_K (q6k) or MXFP4 (mxfp4) rows. */
typedef int (*Product)(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out, int threads);

EXPORT int q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out, int threads);
EXPORT int q8_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w8, int64_t N, float *out, int threads);
EXPORT int q4k_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out, int threads);
EXPORT int q6k_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out, int threads);
EXPORT int mxfp4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out, int threads);
EXPORT int q6k_to_q8_0(const uint8_t *src, int64_t n_blocks, uint8_t *dst, int threads);

/* The row formats of those products, as step.c and experts.c are told them (engine/model/native_decode.py). */
enum { ROWS_Q4 = 0, ROWS_Q8_0 = 1, ROWS_Q4_K = 2, ROWS_Q6_K = 3, ROWS_MXFP4 = 4 };

static inline Product product_of(int64_t kind) {
    return kind == ROWS_MXFP4 ? mxfp4_matmul : kind == ROWS_Q6_K ? q6k_matmul : kind == ROWS_Q4_K ? q4k_matmul
         : kind == ROWS_Q8_0 ? q8_matmul : q4_matmul;
}

#endif
