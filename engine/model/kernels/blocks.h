/* The products of blocks.c that step.c calls (their descriptions are in blocks.c). */
#ifndef STRATA_BLOCKS_H
#define STRATA_BLOCKS_H
#include <stdint.h>

int q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out, int threads);
int q8_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w8, int64_t N, float *out, int threads);

#endif
