/* The sparse experts of one layer for M one-token rows (step.c calls this where a dense layer runs its MLP).

   The router is a float32 product; each row picks its top-k experts (engine/model/moe.py's routings, ties to the
   lower expert index); then each expert that any row picked runs once, as two products over all of its rows, and
   adds its weighted output to each of them. A row's terms are added in ascending expert order starting from zero,
   as the PyTorch path (moe.py's grouped_experts) adds them, and with a shared expert its output comes last, times
   the sigmoid of its gate where it has one (Qwen2-MoE; GLM-4.x MoE's is ungated). gpt-oss's router adds a bias to its logits, and its experts add biases and
   clamp their SwiGLU (as moe.py's clamped_mlp). Every value of a row is computed with the same operations in the same order
   whatever the other rows: the products are blocks.c's (row-invariant), the routing a row's own. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "experts.h"
#include "parallel.h"
#include "vector.h"

#define MAX_TOP_K 64
#define MAX_GROUPS 64

/* A float32 product's arguments, handed to its parts. */
typedef struct {
    const float *x, *w;
    int64_t M, K, N;
    float *out;
} FloatRows;

/* The outputs [begin, end) of float_rows: four lanes of 8 and one fixed reduction per (row, output). */
KERNEL static void float_rows_part(void *job, int64_t begin, int64_t end, int part) {
    const FloatRows *f = job;
    const int64_t M = f->M, K = f->K, N = f->N;
    (void)part;
    for (int64_t n = begin; n < end; n++)
        for (int64_t r = 0; r < M; r++) {
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t k = 0; k < K; k += 32)
                for (int j = 0; j < 4; j++)
                    acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(f->x + r * K + k + 8 * j),
                                             _mm256_loadu_ps(f->w + n * K + k + 8 * j), acc[j]);
            f->out[r * N + n] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        }
}

/* out [M, N] = x [M, K] @ w.T for float32 w [N, K] (K a multiple of 32), the outputs spread over the threads. */
static void float_rows(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *out, int threads) {
    FloatRows job = {x, w, M, K, N, out};
    parallel_for(N, threads, float_rows_part, &job);
}

/* The index of the largest of n values not yet taken (the lowest such index on ties; the first one left when every
   value is NaN), marked taken. */
static int64_t take_largest(const float *v, int64_t n, unsigned char *taken) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    taken[best] = 1;
    return best;
}

/* Keep only the experts of the best topk_group of n_group groups (of consecutive experts) in `choice` [n]: the
   others become -inf. A group ranks by the sum of its two best values, ties to the lower group (moe.py's
   keep_top_groups). */
static void keep_top_groups(float *choice, int64_t n, int64_t n_group, int64_t topk_group, unsigned char *taken) {
    const int64_t size = n / n_group;
    float score[MAX_GROUPS];
    for (int64_t g = 0; g < n_group; g++) {
        float best = -INFINITY, second = -INFINITY;
        for (int64_t i = g * size; i < (g + 1) * size; i++) {
            if (choice[i] > best) { second = best; best = choice[i]; }
            else if (choice[i] > second) second = choice[i];
        }
        score[g] = best + second;
    }
    memset(taken, 0, (size_t)n_group);
    for (int64_t j = 0; j < topk_group; j++) take_largest(score, n_group, taken);
    for (int64_t g = 0; g < n_group; g++)
        if (!taken[g])
            for (int64_t i = g * size; i < (g + 1) * size; i++) choice[i] = -INFINITY;
}

/* A row's k experts in ascending index order and their weights, from its router logits [n]. `probs` and `taken`:
   room for n values. */
static void route(const StepExperts *x, const float *logits, float *probs, unsigned char *taken, int64_t *chosen,
                  float *weight) {
    const int64_t n = x->n_experts, k = x->top_k, routing = x->routing;
    if (routing == SIGMOID_BIAS) {
        for (int64_t i = 0; i < n; i++)
            probs[i] = 1.0f / (1.0f + expf(-logits[i])) + (x->expert_bias ? x->expert_bias[i] : 0.0f);
        if (x->n_group > 1) keep_top_groups(probs, n, x->n_group, x->topk_group, taken);
    }
    memset(taken, 0, (size_t)n);
    if (routing == SIGMOID_BIAS) {
        float picked = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            chosen[j] = take_largest(probs, n, taken);
            picked += weight[j] = 1.0f / (1.0f + expf(-logits[chosen[j]]));
        }
        const float scale = (float)x->routed_scaling;
        for (int64_t j = 0; j < k; j++)
            weight[j] = (x->norm_topk ? weight[j] / (picked + (float)x->norm_eps) : weight[j]) * scale;
    } else if (routing == TOPK_SOFTMAX) {
        for (int64_t j = 0; j < k; j++) chosen[j] = take_largest(logits, n, taken);
        const float top = logits[chosen[0]];
        float total = 0.0f;
        for (int64_t j = 0; j < k; j++) total += weight[j] = expf(logits[chosen[j]] - top);
        for (int64_t j = 0; j < k; j++) weight[j] /= total;
    } else {
        float top = -INFINITY, total = 0.0f;
        for (int64_t i = 0; i < n; i++) top = logits[i] > top ? logits[i] : top;
        for (int64_t i = 0; i < n; i++) total += probs[i] = expf(logits[i] - top);
        for (int64_t i = 0; i < n; i++) probs[i] /= total;
        float picked = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            chosen[j] = take_largest(probs, n, taken);
            picked += weight[j] = probs[chosen[j]];
        }
        if (routing == SOFTMAX_TOPK_NORM)
            for (int64_t j = 0; j < k; j++) weight[j] /= picked;
    }
    for (int64_t j = 1; j < k; j++)  /* ascending expert order: the order a row's terms are added in */
        for (int64_t i = j; i > 0 && chosen[i] < chosen[i - 1]; i--) {
            const int64_t e = chosen[i]; chosen[i] = chosen[i - 1]; chosen[i - 1] = e;
            const float w = weight[i]; weight[i] = weight[i - 1]; weight[i - 1] = w;
        }
}

/* out[r] += w * y over n floats (n a multiple of 8); a multiply, then an add. */
KERNEL static void add_scaled(float *out, const float *y, float w, int64_t n) {
    const __m256 s = _mm256_set1_ps(w);
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i), _mm256_mul_ps(s, _mm256_loadu_ps(y + i))));
}

/* out[i] += b[i] over n floats (n a multiple of 8). */
KERNEL static void add_bias(float *out, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i), _mm256_loadu_ps(b + i)));
}

/* gpt-oss's clamped SwiGLU of a row's [gate | up] (n values each): gate <= limit, -limit <= up <= limit,
   out = (up + 1) (gate / (1 + e^(-alpha gate))), as moe.clamped_mlp computes it. */
KERNEL static void clamped(const float *gate_up, int64_t n, float limit, float alpha, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
    const __m256 minus_alpha = _mm256_set1_ps(-alpha);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 g = _mm256_min_ps(_mm256_loadu_ps(gate_up + i), hi);
        const __m256 u = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(gate_up + n + i), hi), lo);
        const __m256 glu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_mul_ps(minus_alpha, g))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_add_ps(u, one), glu));
    }
}

/* One expert over `rows` rows x [rows, E]: y [rows, E]; gu and act are work room. gate_up_bias and down_bias (gpt-oss,
   else NULL) are this expert's; limit > 0 takes the clamped SwiGLU. */
KERNEL static int expert(const float *x, int64_t rows, int64_t E, int64_t I, const uint8_t *gate_up,
                       const uint8_t *down, Product first, Product second, const float *gate_up_bias,
                       const float *down_bias, float limit, float alpha, float *gu, float *act, float *y,
                       int threads) {
    if (first(x, rows, E, gate_up, 2 * I, gu, threads)) return -1;
    for (int64_t r = 0; r < rows; r++) {
        if (gate_up_bias) add_bias(gu + r * 2 * I, gate_up_bias, 2 * I);
        if (limit > 0.0f)
            clamped(gu + r * 2 * I, I, limit, alpha, act + r * I);
        else
            gated(gu + r * 2 * I, I, SILU, act + r * I);
    }
    if (second(act, rows, I, down, E, y, threads)) return -1;
    if (down_bias)
        for (int64_t r = 0; r < rows; r++) add_bias(y + r * E, down_bias, E);
    return 0;
}

/* out [M, E] = the experts' sum for rows h [M, E] (module comment). Returns 0, -1 when memory ran out, -2 for
   shapes outside what this code handles. */
KERNEL int experts_mlp(const StepExperts *x, int64_t M, int64_t E, const float *h, float *out, int threads) {
    const int64_t NE = x->n_experts, K = x->top_k, S = x->shared_inter;
    const int64_t width = NE + (S > 0 && x->shared_gated), wide = x->inter > S ? x->inter : S;
    if (K <= 0 || K > NE || K > MAX_TOP_K || x->inter % 32 || S % 32 || E % 32) return -2;
    if (x->routing == SIGMOID_BIAS && (x->n_group < 1 || x->n_group > MAX_GROUPS || NE % x->n_group ||
                                       NE / x->n_group < 2 || x->topk_group < 1 || x->topk_group > x->n_group))
        return -2;
    for (int i = 0; i < 4; i++)  /* K-quant rows take whole blocks of 256 values */
        if ((x->kinds[i] == ROWS_Q4_K || x->kinds[i] == ROWS_Q6_K) && (i % 2 == 0 ? E : i == 1 ? x->inter : S) % 256)
            return -2;
    float *logits = malloc(sizeof(float) * M * width), *weights = malloc(sizeof(float) * M * K);
    float *probs = malloc(sizeof(float) * NE), *member_weight = malloc(sizeof(float) * M);
    float *rows = malloc(sizeof(float) * M * E), *y = malloc(sizeof(float) * M * E);
    float *gu = malloc(sizeof(float) * M * 2 * wide), *act = malloc(sizeof(float) * M * wide);
    int64_t *chosen = malloc(sizeof(int64_t) * M * K), *members = malloc(sizeof(int64_t) * M);
    unsigned char *taken = malloc((size_t)NE);
    int status = -1;
    if (!logits || !weights || !probs || !member_weight || !rows || !y || !gu || !act || !chosen || !members || !taken)
        goto done;
    float_rows(h, M, E, x->router, width, logits, threads);
    if (x->router_bias)
        for (int64_t r = 0; r < M; r++)
            for (int64_t i = 0; i < NE; i++) logits[r * width + i] += x->router_bias[i];
    for (int64_t r = 0; r < M; r++)
        route(x, logits + r * width, probs, taken, chosen + r * K, weights + r * K);
    memset(out, 0, sizeof(float) * M * E);
    for (int64_t e = 0; e < NE; e++) {
        int64_t n = 0;
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < K; j++)
                if (chosen[r * K + j] == e) {
                    members[n] = r;
                    member_weight[n++] = weights[r * K + j];
                }
        if (n == 0) continue;
        for (int64_t i = 0; i < n; i++) memcpy(rows + i * E, h + members[i] * E, sizeof(float) * E);
        if (expert(rows, n, E, x->inter, x->gate_up[e], x->down[e], product_of(x->kinds[0]), product_of(x->kinds[1]),
                   x->gate_up_bias ? x->gate_up_bias + e * 2 * x->inter : NULL,
                   x->down_bias ? x->down_bias + e * E : NULL, (float)x->swiglu_limit, (float)x->swiglu_alpha,
                   gu, act, y, threads))
            goto done;
        for (int64_t i = 0; i < n; i++) add_scaled(out + members[i] * E, y + i * E, member_weight[i], E);
    }
    if (S > 0) {
        if (expert(h, M, E, S, x->shared_gate_up, x->shared_down, product_of(x->kinds[2]), product_of(x->kinds[3]),
                   NULL, NULL, 0.0f, 0.0f, gu, act, y, threads))
            goto done;
        for (int64_t r = 0; r < M; r++)
            add_scaled(out + r * E, y + r * E, x->shared_gated ? 1.0f / (1.0f + expf(-logits[r * width + NE])) : 1.0f, E);
    }
    status = 0;
done:
    free(logits); free(weights); free(probs); free(member_weight); free(rows); free(y); free(gu); free(act);
    free(chosen); free(members); free(taken);
    return status;
}
