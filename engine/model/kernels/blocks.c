/* Quantised weight products, written with AVX2, FMA and F16C intrinsics and built for AVX2, AVX-512 or any CPU
   of the architecture (simd.h; engine/model/kernels/build.py builds the three, __init__.py loads the best one
   this CPU runs).

   A 4-bit weight is kept as GGUF Q4_1 blocks of 32 values, one row of blocks per output, each block a float16
   scale, a float16 minimum and 16 bytes of codes (byte j holds value j in its low nibble and value j + 16 in its
   high one, as in the file); value = scale * code + minimum. A row gathers the scales, then the minimums, of each
   run of 8 blocks before the run's codes (engine/model/int4.py, q4_runs): 20 bytes a block as in the file. An 8-bit one (q8_matmul) as GGUF Q8_0 blocks of 34 bytes: a float16
   scale and 32 int8 codes. Activations are rounded to int16 per block of 32 (a float scale each, the block's
   float sum kept for the minimum's term) and multiplied with the codes by integer dot products, four codes of a
   block per instruction and one float multiply-add per block: PyTorch's AVX2 int4 kernel instead widens every
   code to float, which made it 72 % of a decode step on an AVX2 CPU (docs/BENCHMARKS.md).

   Decode streams every weight from memory once a token. One stream of whole blocks, fetched ~1 KiB ahead by
   hand, kept 11.5 GB/s in flight on one thread here where the hardware prefetcher alone kept ~5.8 (the 8-bit
   output matrix: 5.2 -> 2.6 ms); codes, scales and minimums in three arrays were 15-20 % slower than one.

   Every (row, output) pair is computed by one thread with the same operations in the same order, whatever the
   number of rows or threads, so a row's result does not depend on what it shares a call with (batch-invariant
   decode) and the engine's parked and recomputed K/V agree bit for bit. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

#include "blocks.h"
#include "parallel.h"
#include "simd.h"

#define QK 32
#define PREFETCH_BYTES 1024
#define Q4_BLOCK 20 /* float16 scale, float16 minimum, 16 bytes of codes */
#define RUN 8 /* blocks whose scales, then minimums, lie together before their codes */
#define PADDED(nb) (((nb) + RUN - 1) / RUN * RUN) /* an activation row's blocks, zero-padded to whole runs */

/* Whether this CPU runs this build of the kernels (simd.h; the vector builds need their instructions whatever the
   build host had). Baseline code, so that a loader may ask on any CPU. */
EXPORT int blocks_cpu_ok(void) {
#ifdef STRATA_GENERIC
    return 1;
#else
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#ifdef STRATA_AVX512
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
    return avx2;
#endif
#endif
}

/* Which build this is, for the loader's log and the tests: the instruction set (simd.h) and how parts of a
   product run on threads (parallel.c). */
EXPORT const char *kernels_isa(void) { return STRATA_ISA; }
EXPORT const char *kernels_threads(void) { return parallel_kind(); }

/* x rows [M, K] -> int16 codes [M, K], a scale per block [M, PADDED(K / 32)] (the block's largest magnitude /
   32767) and the block's float sum [M, PADDED(K / 32)], the padding left as the caller zeroed it. 8-bit codes (llama.cpp's Q8 activations) moved the bundled model's logits
   1-9 % from float32's: the inputs of the projections after a norm carry outlier channels, and one outlier in a
   block leaves the other 31 values a few levels. 16-bit codes cost the same multiplies (madd_epi16 takes 16
   pairs where maddubs_epi16 takes 32, but needs no second step) and leave the weights' rounding as the error. */
KERNEL static void quantize_rows(const float *x, int64_t M, int64_t K, int16_t *xq, float *xd, float *xs) {
    const int64_t nb = K / QK, padded = PADDED(nb);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < M * nb; r++) {
        const float *v = x + r * QK;
        const int64_t at = r / nb * padded + r % nb;
        __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        __m256 vv[4];
        for (int j = 0; j < 4; j++) {
            vv[j] = _mm256_loadu_ps(v + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, vv[j]));
            sum = _mm256_add_ps(sum, vv[j]);
        }
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float am = _mm_cvtss_f32(m4);
        __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(sum, 1), _mm256_castps256_ps128(sum));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
        xd[at] = am / 32767.0f;
        xs[at] = _mm_cvtss_f32(s4);
        const __m256 mul = _mm256_set1_ps(am > 0 ? 32767.0f / am : 0.0f);
        __m256i i[4];
        for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(vv[j], mul));  /* round to nearest */
        /* packs interleaves 128-bit lanes: restore value order with a 64-bit permute */
        __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[0], i[1]), 0xD8);
        __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[2], i[3]), 0xD8);
        _mm256_storeu_si256((__m256i *)(xq + r * QK), p01);
        _mm256_storeu_si256((__m256i *)(xq + r * QK + 16), p23);
    }
}

/* The activations of one product, rounded by quantize_rows. */
typedef struct {
    int16_t *q;
    float *scale, *sum;
} Activations;

static void release(Activations *a) {
    free(a->q); free(a->scale); free(a->sum);
}

/* Returns 0, or -1 when there is no memory for them. */
KERNEL static int prepare(const float *x, int64_t M, int64_t K, Activations *a) {
    const int64_t nb = PADDED(K / QK);
    a->q = malloc(sizeof(int16_t) * M * K);
    a->scale = calloc(M * nb, sizeof(float));
    a->sum = calloc(M * nb, sizeof(float));
    if (!a->q || !a->scale || !a->sum) {
        release(a);
        return -1;
    }
    quantize_rows(x, M, K, a->q, a->scale, a->sum);
    return 0;
}

/* TILE(rows, outputs) over the outputs [begin, end) of a part: with fewer than 4 rows (decode, a few verify rows)
   one output at a time, one weight row streaming from memory (two rows read side by side kept ~9 GB/s in flight on
   one thread here, one ~16, at the same prefetch), all rows in one tile so each weight block is widened once for
   them; else the part's output pairs (n, n + 1) (begin and end count pairs), rows of x in tiles of 4, then the 1-3
   left in one tile, each weight block loaded once for a tile's rows and each activation block once for 2 outputs. */
#define REST_OF_ROWS(TILE, rn)                                                                                 \
    switch (M - m) {                                                                                           \
    case 3: TILE(3, rn); break;                                                                                \
    case 2: TILE(2, rn); break;                                                                                \
    case 1: TILE(1, rn); break;                                                                                \
    default: break;                                                                                            \
    }
#define FOR_EACH_TILE(TILE)                                                                                   \
    if (M < 4) {                                                                                               \
        for (int64_t n = begin; n < end; n++) {                                                                \
            const int64_t m = 0;                                                                               \
            REST_OF_ROWS(TILE, 1)                                                                              \
        }                                                                                                      \
    } else {                                                                                                   \
        for (int64_t np = begin; np < end; np++) {                                                             \
            const int64_t n = 2 * np;                                                                          \
            int64_t m = 0;                                                                                     \
            if (n + 1 < N) {                                                                                   \
                for (; m + 4 <= M; m += 4) TILE(4, 2);                                                         \
                REST_OF_ROWS(TILE, 2)                                                                          \
            } else {                                                                                           \
                for (; m + 4 <= M; m += 4) TILE(4, 1);                                                         \
                REST_OF_ROWS(TILE, 1)                                                                          \
            }                                                                                                  \
        }                                                                                                      \
    }

/* One product's arguments, handed to its parts. */
typedef struct {
    int64_t M, K, N;
    Activations a;
    const uint8_t *w;
    float *out;
} Job;

KERNEL static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}


/* One tile: rows m0..m0+RM of x against weight rows n0..n0+RN. Per run of 8 blocks the scales are converted and
   multiplied by the activations' scales as one vector, and the minimums' term is one multiply-add; per block the
   codes are widened once and dotted with the int16 activations, and the sum scaled by its lane of the run's
   scales. Each (m, n) accumulates its runs and blocks in order with the same operations whatever the tile, so a
   row's result does not depend on M or on the threads. */
KERNEL static inline __attribute__((always_inline)) void tile(
    int RM, int RN, int64_t m0, int64_t n0, int64_t K, int64_t N, const int16_t *xq, const float *xd,
    const float *xs, const uint8_t *w, float *out) {
    const int64_t nb = K / QK, padded = PADDED(nb), row = nb * Q4_BLOCK;
    const __m256i low = _mm256_set1_epi16(0x0F);
    __m256 acc[4][2], accm[4][2];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) { acc[i][j] = _mm256_setzero_ps(); accm[i][j] = _mm256_setzero_ps(); }
    for (int64_t b0 = 0; b0 < nb; b0 += RUN) {
        const int64_t c = nb - b0 < RUN ? nb - b0 : RUN;
        const uint8_t *run[2];
        __m256 ds[4][2];
        for (int j = 0; j < RN; j++) {
            run[j] = w + (n0 + j) * row + b0 * Q4_BLOCK;
            _mm_prefetch((const char *)(run[j] + PREFETCH_BYTES), _MM_HINT_T0);
            _mm_prefetch((const char *)(run[j] + PREFETCH_BYTES + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(run[j] + PREFETCH_BYTES + 128), _MM_HINT_T0);
            __m256 d, mn;
            if (c == RUN) {
                d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)run[j]));
                mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(run[j] + 2 * RUN)));
            } else {
                uint16_t h[2 * RUN] = {0};
                memcpy(h, run[j], 2 * c);
                memcpy(h + RUN, run[j] + 2 * c, 2 * c);
                d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
                mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + RUN)));
            }
            for (int i = 0; i < RM; i++) {
                ds[i][j] = _mm256_mul_ps(d, _mm256_loadu_ps(xd + (m0 + i) * padded + b0));
                accm[i][j] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(xs + (m0 + i) * padded + b0), accm[i][j]);
            }
        }
        for (int64_t k = 0; k < c; k++) {
            const __m256i lane = _mm256_set1_epi32((int)k);
            __m256i w0[2], w1[2];
            for (int j = 0; j < RN; j++) {
                const __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(run[j] + 4 * c + 16 * k)));
                w0[j] = _mm256_and_si256(raw, low);
                w1[j] = _mm256_srli_epi16(raw, 4);
            }
            for (int i = 0; i < RM; i++) {
                const int16_t *a = xq + (m0 + i) * K + (b0 + k) * QK;
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)a);
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(a + 16));
                for (int j = 0; j < RN; j++) {
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0[j], x0), _mm256_madd_epi16(w1[j], x1));
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(ds[i][j], lane), acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) out[(m0 + i) * N + n0 + j] = hsum(acc[i][j]) + hsum(accm[i][j]);
}

#define TILE(rm, rn) tile(rm, rn, m, n, K, N, a.q, a.scale, a.sum, w, out)

/* A product's entry point: out [M, N] = x [M, K] @ w.T, every (row, output) through TILE_OF, the outputs (output
   pairs from 4 rows on) spread over the threads; returns 0, or -1 when the activations' int16 copy could not be
   allocated. */
#define PRODUCT(name, TILE_OF)                                                                                 \
    KERNEL static void name##_part(void *job, int64_t begin, int64_t end, int part) {                          \
        const Job *j = job;                                                                                    \
        const int64_t M = j->M, K = j->K, N = j->N;                                                            \
        const Activations a = j->a;                                                                            \
        const uint8_t *w = j->w;                                                                               \
        float *out = j->out;                                                                                   \
        (void)part;                                                                                            \
        FOR_EACH_TILE(TILE_OF)                                                                                 \
    }                                                                                                          \
    EXPORT KERNEL int name(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *out,      \
                           int threads) {                                                                      \
        Job j = {M, K, N, {0, 0, 0}, w, out};                                                                  \
        if (prepare(x, M, K, &j.a)) return -1;                                                                 \
        parallel_for(M < 4 ? N : (N + 1) / 2, threads, name##_part, &j);                                       \
        release(&j.a);                                                                                         \
        return 0;                                                                                              \
    }

/* w as Q4 blocks (described at the top); K a multiple of 32. */
PRODUCT(q4_matmul, TILE)

/* Q8_0 rows (an output matrix kept in the file's 8-bit blocks): the same activations and order of operations per
   (row, output) as q4_matmul, no minimum term. */
KERNEL static inline __attribute__((always_inline)) void tile8(
    int RM, int RN, int64_t m0, int64_t n0, int64_t K, int64_t N, const int16_t *xq, const float *xd,
    const uint8_t *w8, float *out) {
    const int64_t nb = K / QK, row = nb * 34;
    __m256 acc[4][2];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i w0[2], w1[2];
        float ws[2];
        for (int j = 0; j < RN; j++) {
            const uint8_t *block = w8 + (n0 + j) * row + b * 34;
            _mm_prefetch((const char *)(block + PREFETCH_BYTES), _MM_HINT_T0);
            uint16_t d;
            memcpy(&d, block, 2);
            ws[j] = _cvtsh_ss(d);
            w0[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 2)));
            w1[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 18)));
        }
        for (int i = 0; i < RM; i++) {
            const int16_t *a = xq + (m0 + i) * K + b * QK;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)a);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(a + 16));
            const float ad = xd[(m0 + i) * PADDED(nb) + b];
            for (int j = 0; j < RN; j++) {
                const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0[j], x0), _mm256_madd_epi16(w1[j], x1));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(ws[j] * ad), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) out[(m0 + i) * N + n0 + j] = hsum(acc[i][j]);
}

#define TILE8(rm, rn) tile8(rm, rn, m, n, K, N, a.q, a.scale, w, out)

/* w as Q8_0 rows (above); K a multiple of 32. */
PRODUCT(q8_matmul, TILE8)

/* GGUF's MXFP4 blocks as the file holds them (gpt-oss's expert stacks, engine/model/kquant_weight.py): 32 values a
   block of 17 bytes, an e8m0 exponent byte e, then 16 bytes of e2m1 codes (byte j: value j in its low nibble,
   value j + 16 in its high one); value = kvalue[code] 2^(e - 128), kvalue the e2m1 values doubled (llama.cpp's
   kvalues_mxfp4: integers -12..12). The codes become int16 through that table and are dotted with the int16
   activations as q8_matmul's are (|kvalue| <= 12 keeps a block's sums in int32), then one multiply-add per block
   with its power of two times the activations' scale: a row's operations are the same whatever the tile, so
   rows stay batch- and thread-invariant. 4.25 bits a weight, as the file. */
#define MXFP4_BLOCK 17

/* A block's 32 codes as int16 values of the table (the two halves: values 0-15, then 16-31). AVX2 looks them up
   16 at a time with a byte shuffle; the generic build one by one (the same integers). */
KERNEL static inline void mxfp4_values(const uint8_t *codes, __m256i *first, __m256i *second) {
#ifdef STRATA_GENERIC
    static const int16_t table[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    int16_t v[32];
    for (int i = 0; i < 16; i++) {
        v[i] = table[codes[i] & 0x0F];
        v[16 + i] = table[codes[i] >> 4];
    }
    *first = _mm256_loadu_si256((const __m256i *)v);
    *second = _mm256_loadu_si256((const __m256i *)(v + 16));
#else
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i nibble = _mm_set1_epi8(0x0F), raw = _mm_loadu_si128((const __m128i *)codes);
    *first = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(raw, nibble)));
    *second = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), nibble)));
#endif
}

/* 2^(e - 128), exactly, from its bits (ggml's e8m0 half). A libm ldexpf call per block and row made a 2880 x 2880
   product of one row take 1.17 ms on one thread here (best of 5), 0.36 ms this way (Q8_0 rows: 0.30). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

KERNEL static inline __attribute__((always_inline)) void tile_mx(
    int RM, int RN, int64_t m0, int64_t n0, int64_t K, int64_t N, const int16_t *xq, const float *xd,
    const uint8_t *w, float *out) {
    const int64_t nb = K / QK, row = nb * MXFP4_BLOCK;
    __m256 acc[4][2];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i w0[2], w1[2];
        float ws[2];
        for (int j = 0; j < RN; j++) {
            const uint8_t *block = w + (n0 + j) * row + b * MXFP4_BLOCK;
            _mm_prefetch((const char *)(block + PREFETCH_BYTES), _MM_HINT_T0);
            ws[j] = e8m0_half(block[0]);
            mxfp4_values(block + 1, &w0[j], &w1[j]);
        }
        for (int i = 0; i < RM; i++) {
            const int16_t *a = xq + (m0 + i) * K + b * QK;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)a);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(a + 16));
            const float ad = xd[(m0 + i) * PADDED(nb) + b];
            for (int j = 0; j < RN; j++) {
                const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0[j], x0), _mm256_madd_epi16(w1[j], x1));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(ws[j] * ad), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) out[(m0 + i) * N + n0 + j] = hsum(acc[i][j]);
}

#define TILE_MX(rm, rn) tile_mx(rm, rn, m, n, K, N, a.q, a.scale, w, out)

/* w as MXFP4 rows (above); K a multiple of 32. */
PRODUCT(mxfp4_matmul, TILE_MX)

/* GGUF's Q4_K blocks, read as the file holds them (mixture-of-experts stacks, engine/model/kquant_weight.py): 256
   values a block of 144 bytes, a float16 d and dmin, the 6-bit scale and minimum of each of its 8 groups of 32
   packed in 12 bytes, then 128 bytes of codes: bytes 32p..32p+31 hold group 2p in their low nibbles and group
   2p + 1 in their high ones; value = d scale_g code - dmin minimum_g. The same activations and the same
   operations per group as q4_matmul (one integer dot product and one multiply-add per group, the minimums'
   term per block), so rows stay batch- and thread-invariant. */
#define QK_K 256
#define Q4K_BLOCK 144

/* A block's 8 group scales (d scale_g) and negated minimums (-dmin minimum_g) as float vectors. The 6-bit fields
   are unpacked four bytes at a time: groups 0-3 are the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums),
   groups 4-7 the nibbles of bytes 8-11 with the top 2 bits of bytes 0-3 and 4-7 above them. */
KERNEL static inline void q4k_scales(const uint8_t *block, __m256 *scale, __m256 *minimum) {
    uint32_t a, b, c;
    memcpy(&a, block + 4, 4);
    memcpy(&b, block + 8, 4);
    memcpy(&c, block + 12, 4);
    const uint64_t scales = (uint64_t)(a & 0x3F3F3F3Fu) | (uint64_t)((c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)) << 32;
    const uint64_t minimums = (uint64_t)(b & 0x3F3F3F3Fu) | (uint64_t)(((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u)) << 32;
    uint16_t d, dmin;
    memcpy(&d, block, 2);
    memcpy(&dmin, block + 2, 2);
    *scale = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d)),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)scales))));
    *minimum = _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(dmin)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)minimums))));
}

KERNEL static inline __attribute__((always_inline)) void tile_k(
    int RM, int RN, int64_t m0, int64_t n0, int64_t K, int64_t N, const int16_t *xq, const float *xd,
    const float *xs, const uint8_t *w, float *out) {
    const int64_t nb = K / QK_K, row = nb * Q4K_BLOCK, groups = K / QK; /* groups == PADDED(groups): K % 256 == 0 */
    const __m256i low = _mm256_set1_epi16(0x0F);
    __m256 acc[4][2], accm[4][2];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) { acc[i][j] = _mm256_setzero_ps(); accm[i][j] = _mm256_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block[2];
        __m256 ds[4][2];
        for (int j = 0; j < RN; j++) {
            block[j] = w + (n0 + j) * row + b * Q4K_BLOCK;
            _mm_prefetch((const char *)(block[j] + PREFETCH_BYTES), _MM_HINT_T0);
            _mm_prefetch((const char *)(block[j] + PREFETCH_BYTES + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(block[j] + PREFETCH_BYTES + 128), _MM_HINT_T0);
            __m256 scale, minimum;
            q4k_scales(block[j], &scale, &minimum);
            for (int i = 0; i < RM; i++) {
                ds[i][j] = _mm256_mul_ps(scale, _mm256_loadu_ps(xd + (m0 + i) * groups + 8 * b));
                accm[i][j] = _mm256_fmadd_ps(minimum, _mm256_loadu_ps(xs + (m0 + i) * groups + 8 * b), accm[i][j]);
            }
        }
        for (int p = 0; p < 4; p++) {
            const __m256i even = _mm256_set1_epi32(2 * p), odd = _mm256_set1_epi32(2 * p + 1);
            __m256i lo[2][2], hi[2][2];
            for (int j = 0; j < RN; j++) {
                const uint8_t *q = block[j] + 16 + 32 * p;
                for (int half = 0; half < 2; half++) {
                    const __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * half)));
                    lo[j][half] = _mm256_and_si256(raw, low);
                    hi[j][half] = _mm256_srli_epi16(raw, 4);
                }
            }
            for (int i = 0; i < RM; i++) {
                const int16_t *a = xq + (m0 + i) * K + b * QK_K + 64 * p; /* group 2p, then group 2p + 1 */
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)a);
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(a + 16));
                const __m256i y0 = _mm256_loadu_si256((const __m256i *)(a + 32));
                const __m256i y1 = _mm256_loadu_si256((const __m256i *)(a + 48));
                for (int j = 0; j < RN; j++) {
                    const __m256i pe = _mm256_add_epi32(_mm256_madd_epi16(lo[j][0], x0), _mm256_madd_epi16(lo[j][1], x1));
                    const __m256i po = _mm256_add_epi32(_mm256_madd_epi16(hi[j][0], y0), _mm256_madd_epi16(hi[j][1], y1));
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pe), _mm256_permutevar8x32_ps(ds[i][j], even), acc[i][j]);
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(po), _mm256_permutevar8x32_ps(ds[i][j], odd), acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) out[(m0 + i) * N + n0 + j] = hsum(acc[i][j]) + hsum(accm[i][j]);
}

#define TILE_K(rm, rn) tile_k(rm, rn, m, n, K, N, a.q, a.scale, a.sum, w, out)

/* w as Q4_K rows (above); K a multiple of 256. */
PRODUCT(q4k_matmul, TILE_K)

/* GGUF's Q6_K blocks as the file holds them (a Q4_K_M file's output matrix, value projections and some down
   projections): 256 values a block of 210 bytes, the low 4 bits of each value (128 bytes), their high 2 bits (64
   bytes), an int8 scale per 16 values (16 bytes), then a float16 d; value = d scale (q - 32). In each half of
   128 values, group g (32 values) takes the low nibbles (g = 0, 1) or high nibbles (g = 2, 3) of bytes 32 (g % 2)
   on of the half's low bits, and bits 2g, 2g + 1 of the half's 32 high-bit bytes. Each 16 values' codes, times
   their scale, are dotted with the int16 activations (|q - 32| <= 32 and |scale| <= 128 keep the products in
   int16 and a group's sum in int32), then one multiply-add per group of 32 as q8_matmul does. */
#define Q6K_BLOCK 210

KERNEL static inline __attribute__((always_inline)) void tile_6k(
    int RM, int RN, int64_t m0, int64_t n0, int64_t K, int64_t N, const int16_t *xq, const float *xd,
    const uint8_t *w, float *out) {
    const int64_t nb = K / QK_K, row = nb * Q6K_BLOCK, groups = K / QK;
    const __m256i low = _mm256_set1_epi16(0x0F), high = _mm256_set1_epi16(0x30), offset = _mm256_set1_epi16(32);
    __m256 acc[4][2];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block[2];
        float d[2];
        for (int j = 0; j < RN; j++) {
            block[j] = w + (n0 + j) * row + b * Q6K_BLOCK;
            for (int line = 0; line < 4; line++)
                _mm_prefetch((const char *)(block[j] + PREFETCH_BYTES + 64 * line), _MM_HINT_T0);
            uint16_t h;
            memcpy(&h, block[j] + 208, 2);
            d[j] = _cvtsh_ss(h);
        }
        for (int g = 0; g < 8; g++) { /* group g of 32 values: half g / 4, g % 4 within it */
            const int half = g / 4, within = g % 4;
            __m256i q[2][2];
            for (int j = 0; j < RN; j++)
                for (int part = 0; part < 2; part++) { /* values 16 part .. 16 part + 15 of the group */
                    const uint8_t *lo_bits = block[j] + 64 * half + 32 * (within % 2) + 16 * part;
                    const uint8_t *hi_bits = block[j] + 128 + 32 * half + 16 * part;
                    const __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)lo_bits));
                    const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)hi_bits));
                    const __m256i nibble = within < 2 ? _mm256_and_si256(a, low) : _mm256_srli_epi16(a, 4);
                    const __m256i top = within == 0 ? _mm256_slli_epi16(h, 4) : within == 1 ? _mm256_slli_epi16(h, 2)
                                      : within == 2 ? h : _mm256_srli_epi16(h, 2);
                    const __m256i code = _mm256_sub_epi16(_mm256_or_si256(nibble, _mm256_and_si256(top, high)), offset);
                    const int8_t scale = (int8_t)block[j][192 + 8 * half + 2 * within + part];
                    q[j][part] = _mm256_mullo_epi16(code, _mm256_set1_epi16(scale));
                }
            for (int i = 0; i < RM; i++) {
                const int16_t *a = xq + (m0 + i) * K + b * QK_K + 32 * g;
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)a);
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(a + 16));
                const float ad = xd[(m0 + i) * groups + 8 * b + g];
                for (int j = 0; j < RN; j++) {
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(q[j][0], x0), _mm256_madd_epi16(q[j][1], x1));
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[j] * ad), acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) out[(m0 + i) * N + n0 + j] = hsum(acc[i][j]);
}

/* tile_6k for one row and one output (decode), its loads shared: each 16 bytes of low bits and of high bits are
   widened once for the two or four groups that take them, and each group's two halves summed as integers before
   its multiply-add, in the same group order: the same result as tile_6k (integer sums are exact). A cold
   49K x 1024 matrix on one thread here: 3.8-4.0 ms against tile_6k's 5.5 (Q8_0 rows of it: 2.8-3.2 ms, which is
   why an output matrix the file holds as Q6_K is still made Q8_0 rows). */
KERNEL static inline void tile_6k_row(int64_t m0, int64_t n0, int64_t K, int64_t N, const int16_t *xq,
                                    const float *xd, const uint8_t *w, float *out) {
    const int64_t nb = K / QK_K, row = nb * Q6K_BLOCK, groups = K / QK;
    const __m256i low = _mm256_set1_epi16(0x0F), high = _mm256_set1_epi16(0x30), offset = _mm256_set1_epi16(32);
    const int16_t *x = xq + m0 * K;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + n0 * row + b * Q6K_BLOCK;
        for (int line = 0; line < 4; line++)
            _mm_prefetch((const char *)(block + PREFETCH_BYTES + 64 * line), _MM_HINT_T0);
        uint16_t h16;
        memcpy(&h16, block + 208, 2);
        const float d = _cvtsh_ss(h16);
        const int8_t *scales = (const int8_t *)(block + 192);
        __m256i sums[8];
        for (int half = 0; half < 2; half++)
            for (int part = 0; part < 2; part++) {
                const uint8_t *lo_bits = block + 64 * half + 16 * part;
                const __m256i a0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)lo_bits));
                const __m256i a1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(lo_bits + 32)));
                const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(block + 128 + 32 * half + 16 * part)));
                const __m256i codes[4] = {
                    _mm256_or_si256(_mm256_and_si256(a0, low), _mm256_and_si256(_mm256_slli_epi16(h, 4), high)),
                    _mm256_or_si256(_mm256_and_si256(a1, low), _mm256_and_si256(_mm256_slli_epi16(h, 2), high)),
                    _mm256_or_si256(_mm256_srli_epi16(a0, 4), _mm256_and_si256(h, high)),
                    _mm256_or_si256(_mm256_srli_epi16(a1, 4), _mm256_and_si256(_mm256_srli_epi16(h, 2), high))};
                for (int within = 0; within < 4; within++) {
                    const int g = 4 * half + within;
                    const __m256i q = _mm256_mullo_epi16(_mm256_sub_epi16(codes[within], offset),
                                                         _mm256_set1_epi16(scales[8 * half + 2 * within + part]));
                    const __m256i p = _mm256_madd_epi16(q, _mm256_loadu_si256((const __m256i *)(x + b * QK_K + 32 * g + 16 * part)));
                    sums[g] = part == 0 ? p : _mm256_add_epi32(sums[g], p);
                }
            }
        for (int g = 0; g < 8; g++)
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[g]), _mm256_set1_ps(d * xd[m0 * groups + 8 * b + g]), acc);
    }
    out[m0 * N + n0] = hsum(acc);
}

/* Fewer than 4 rows against one output: each row through tile_6k_row, as one row always went (whether tile_6k's
   widening a block once for 2 or 3 rows would beat its shared loads is not measured). */
KERNEL static inline void rows_6k(int RM, int64_t m0, int64_t n0, int64_t K, int64_t N, const int16_t *xq,
                                  const float *xd, const uint8_t *w, float *out) {
    for (int i = 0; i < RM; i++) tile_6k_row(m0 + i, n0, K, N, xq, xd, w, out);
}

#define TILE_6K(rm, rn) \
    ((rm) < 4 && (rn) == 1 ? rows_6k(rm, m, n, K, N, a.q, a.scale, w, out) : tile_6k(rm, rn, m, n, K, N, a.q, a.scale, w, out))

/* w as Q6_K rows (above); K a multiple of 256. */
PRODUCT(q6k_matmul, TILE_6K)

/* Q6_K blocks -> Q8_0 rows, for the tensors a GGUF holds as Q6_K that the engine keeps as Q8_0 rows (q6k_matmul
   decodes slower than q8_matmul): byte for byte what q8_weight.q8_0_rows makes of gguf_dequant's float32 values
   (each value (d scale) (q - 32) in float32, each block of 32 a float16 scale of its largest magnitude / 127,
   rounded to nearest even, and codes rounded to nearest even), without the float copy or PyTorch's passes over
   it; blocks are independent, spread over `threads`. Returns 0, or -1 when a block's d or a Q8_0 scale is not a
   finite float16 (q8_0_rows refuses those too). */
/* The blocks [begin, end) of a q6k_to_q8_0 call. */
typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    int bad;  /* set (atomically) by a part that met a bad block */
} Conversion;

KERNEL static void q6k_to_q8_0_part(void *job, int64_t begin, int64_t end, int part) {
    Conversion *c = job;
    int bad = 0;
    (void)part;
    for (int64_t b = begin; b < end; b++) {
        const uint8_t *block = c->src + b * Q6K_BLOCK;
        uint16_t h;
        memcpy(&h, block + 208, 2);
        const float d = _cvtsh_ss(h);
        if (!isfinite(d)) {
            bad = 1;
            continue;
        }
        float v[QK_K];
        for (int i = 0; i < QK_K; i++) {
            const int half = i / 128, within = (i % 128) / 32, l = i % 32;
            const uint8_t low_bits = block[64 * half + 32 * (within % 2) + l];
            const int code = (within < 2 ? low_bits & 0xF : low_bits >> 4) | (((block[128 + 32 * half + l] >> (2 * within)) & 3) << 4);
            v[i] = (d * (float)(int8_t)block[192 + i / 16]) * (float)(code - 32);
        }
        for (int g = 0; g < QK_K / QK; g++) {
            const float *x = v + QK * g;
            float largest = 0.0f;
            for (int i = 0; i < QK; i++) largest = fabsf(x[i]) > largest ? fabsf(x[i]) : largest;
            const uint16_t scale = _cvtss_sh(largest / 127.0f, 0);
            const float wide = _cvtsh_ss(scale);
            bad |= !isfinite(wide);
            const float safe = wide == 0.0f ? 1.0f : wide;
            uint8_t *out = c->dst + (b * (QK_K / QK) + g) * 34;
            memcpy(out, &scale, 2);
            for (int i = 0; i < QK; i++) {
                float q = nearbyintf(x[i] / safe);
                q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
                out[2 + i] = (uint8_t)(int8_t)q;
            }
        }
    }
    if (bad) __atomic_store_n(&c->bad, 1, __ATOMIC_RELAXED);
}

EXPORT int q6k_to_q8_0(const uint8_t *src, int64_t n_blocks, uint8_t *dst, int threads) {
    Conversion c = {src, dst, 0};
    parallel_for(n_blocks, threads, q6k_to_q8_0_part, &c);
    return c.bad ? -1 : 0;
}
