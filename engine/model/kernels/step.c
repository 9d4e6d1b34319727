/* A whole decode step of a dense Llama-family model (Gemma 3 included) with 4-bit or 8-bit weights, in one call
   (engine/model/native_decode.py describes when the engine takes it).

   Run through PyTorch, a decode step of the bundled model on one thread of an AVX2 CPU spends ~12.5 of ~18 ms in
   the weight products and the rest in ~1,500 small operator calls (norms, RoPE, K/V writes, attention, SiLU, the
   residual adds) and the Python around them. Here the same step is one loop over the layers: the products are
   blocks.c's, everything between them is a few passes over vectors of a few hundred floats.

   Invariants, as blocks.c's: every value of a row (its norms, its attention heads, its products) is computed by
   one thread with the same operations in the same order whatever the other rows of the call, their number or the
   thread count; so a row's logits and K/V do not depend on what it was batched with. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "experts.h"
#include "parallel.h"
#include "vector.h"

enum { KV_FLOAT32 = 0, KV_BFLOAT16 = 1, KV_FLOAT16 = 2 };
/* Head sizes this code takes (engine/model/native_decode.py checks them): a head's values, and those of the query
   heads sharing a K/V head, kept in registers or on the stack. */
#define MAX_HEAD_DIM 512
#define MAX_GROUP_WIDTH 4096

/* One layer's weights and K/V (mirrored by engine/model/native_decode.py's StepLayer). */
typedef struct {
    const float *attn_norm, *mlp_norm;     /* [hidden] */
    const uint8_t *wqkv;                   /* rows [(H + 2 KVH) D] in the format kinds[0] says */
    const float *bqkv;                     /* [(H + 2 KVH) D] or NULL */
    const uint8_t *wo, *w_gate_up, *w_down;
    const float *qk_norm;                  /* per-head q then k norm weights [H + KVH, D], or NULL */
    const float *post_attn_norm, *post_mlp_norm;  /* Gemma's norms of the attention and MLP outputs, or NULL */
    void *k_cache, *v_cache;               /* [slots, ctx, KVH, D] in the K/V dtype */
    int64_t window;                        /* a sliding layer's window; 0: every earlier key */
    int64_t local;                         /* 1: RoPE from the local table (Gemma's sliding layers) */
    int64_t kinds[4];                      /* ROWS_* (blocks.h) of wqkv, wo, w_gate_up, w_down */
    const StepExperts *experts;            /* a sparse expert block instead of the dense MLP (experts.c), or NULL */
    const float *sinks;                    /* gpt-oss: a logit per query head [H] in each softmax's denominator, or NULL */
    const float *bo;                       /* gpt-oss: the output projection's bias [hidden], or NULL */
} StepLayer;

/* The model (mirrored by StepModel there). */
typedef struct {
    int64_t n_layers, hidden, inter, n_heads, n_kv_heads, head_dim, ctx, vocab;
    int64_t kv_dtype, head_kind, activation;  /* head_kind: the output matrix's ROWS_* */
    double eps, scale;                     /* RMSNorm epsilon; the attention scores' factor */
    const StepLayer *layers;
    const float *norm;                     /* the final norm [hidden] */
    const uint8_t *head;                   /* the output matrix: Q4 or Q8_0 blocks [vocab rows] */
    int64_t rotary_dim;                    /* the leading channels of a head RoPE turns (GLM-4.x MoE: half) */
} StepModel;

/* Sum of squares of n floats (n a multiple of 8), eight lanes then one fixed reduction. */
KERNEL static inline float squares(const float *x, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    return hsum8(acc);
}

/* out = x / sqrt(mean(x^2) + eps) * w over n floats (RMSNorm; x and out may be the same). */
KERNEL static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    const __m256 r = _mm256_set1_ps(1.0f / sqrtf(squares(x, n) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), r), _mm256_loadu_ps(w + i)));
}

/* Rotate-half RoPE of a head's leading D channels in place: x[i] cos[i] - x[i + D/2] sin[i] for the first half,
   x[i] cos[i] + x[i - D/2] sin[i] for the second (cos and sin the position's rows of the model's table); the
   channels past D (partial RoPE) pass. */
KERNEL static void rope(float *x, const float *cos, const float *sin, int64_t D) {
    const int64_t half = D / 2;
    float rotated[MAX_HEAD_DIM];
    for (int64_t i = 0; i < half; i++) {
        rotated[i] = x[i] * cos[i] - x[i + half] * sin[i];
        rotated[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
    memcpy(x, rotated, sizeof(float) * D);
}

/* Eight values of a K/V row from `index` on, as floats. */
KERNEL static inline __m256 load8(const void *row, int64_t index, int64_t dtype) {
    if (dtype == KV_FLOAT32) return _mm256_loadu_ps((const float *)row + index);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + index));
    if (dtype == KV_FLOAT16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* A float as bfloat16, rounded to nearest even (as PyTorch converts). */
static inline uint16_t to_bfloat16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  /* NaN */
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* n floats (a multiple of 8) stored in the K/V dtype at row. */
KERNEL static void store_kv(void *row, const float *x, int64_t n, int64_t dtype) {
    if (dtype == KV_FLOAT32) {
        memcpy(row, x, sizeof(float) * n);
    } else if (dtype == KV_FLOAT16) {
        for (int64_t i = 0; i < n; i += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)row + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        for (int64_t i = 0; i < n; i++) ((uint16_t *)row)[i] = to_bfloat16(x[i]);
    }
}

/* The `group` query heads of one K/V head (consecutive in q) against its keys [first, first + n):
   softmax(scale q.k) v for each, into out [group, D]. Each key and value row is read once for the whole group, as
   PyTorch's grouped bmm reads it. `stride`: values between two positions' rows; `scores`: room for group x n
   rounded up to 8; `sinks` (gpt-oss, else NULL): each head's sink logit, one more term of its softmax's maximum
   and denominator with no value. Inlined for the usual head sizes, so that the compiler keeps a row in registers. */
KERNEL static inline __attribute__((always_inline)) void attend_group(
    const float *q, int64_t group, const void *k, const void *v, int64_t dtype, int64_t stride, int64_t first,
    int64_t n, int64_t D, float scale, const float *sinks, float *scores, float *out) {
    const int64_t padded = (n + 7) & ~(int64_t)7, lanes = D / 8;
    __m256 qs[MAX_GROUP_WIDTH / 8], acc[MAX_GROUP_WIDTH / 8], row[MAX_HEAD_DIM / 8];
    for (int64_t i = 0; i < group * lanes; i++) qs[i] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * i), _mm256_set1_ps(scale));
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = (first + t) * stride;
        for (int64_t d = 0; d < lanes; d++) row[d] = load8(k, at + 8 * d, dtype);
        for (int64_t g = 0; g < group; g++) {
            __m256 dot = _mm256_setzero_ps();
            for (int64_t d = 0; d < lanes; d++) dot = _mm256_fmadd_ps(qs[g * lanes + d], row[d], dot);
            scores[g * padded + t] = hsum8(dot);
        }
    }
    for (int64_t g = 0; g < group; g++) {  /* softmax of each head's scores, in place */
        float *s = scores + g * padded;
        float best = -INFINITY;
        for (int64_t t = 0; t < n; t++) best = s[t] > best ? s[t] : best;
        if (sinks) best = sinks[g] > best ? sinks[g] : best;
        for (int64_t t = n; t < padded; t++) s[t] = -INFINITY;
        __m256 total = _mm256_setzero_ps();
        for (int64_t t = 0; t < padded; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(best)));
            _mm256_storeu_ps(s + t, e);
            total = _mm256_add_ps(total, e);
        }
        const float sink = sinks ? expf(sinks[g] - best) : 0.0f;
        const __m256 inv = _mm256_set1_ps(1.0f / (hsum8(total) + sink));
        for (int64_t t = 0; t < padded; t += 8) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inv));
    }
    for (int64_t i = 0; i < group * lanes; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = (first + t) * stride;
        for (int64_t d = 0; d < lanes; d++) row[d] = load8(v, at + 8 * d, dtype);
        for (int64_t g = 0; g < group; g++) {
            const __m256 p = _mm256_set1_ps(scores[g * padded + t]);
            for (int64_t d = 0; d < lanes; d++) acc[g * lanes + d] = _mm256_fmadd_ps(p, row[d], acc[g * lanes + d]);
        }
    }
    for (int64_t i = 0; i < group * lanes; i++) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

KERNEL static void attend(const float *q, int64_t group, const void *k, const void *v, int64_t dtype, int64_t stride,
                        int64_t first, int64_t n, int64_t D, float scale, const float *sinks, float *scores,
                        float *out) {
    if (D == 64)
        attend_group(q, group, k, v, dtype, stride, first, n, 64, scale, sinks, scores, out);
    else if (D == 128)
        attend_group(q, group, k, v, dtype, stride, first, n, 128, scale, sinks, scores, out);
    else
        attend_group(q, group, k, v, dtype, stride, first, n, D, scale, sinks, scores, out);
}


KERNEL static void add_rows(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

/* One layer's attention over the (row, K/V head) pairs, handed to its parts; `scores` holds a room of
   `scores_per_part` floats for each part. */
typedef struct {
    const StepModel *m;
    const StepLayer *L;
    const int64_t *slots, *positions;
    const float *qkv;
    float *attn, *scores;
    int64_t scores_per_part;
} Attention;

KERNEL static void attention_part(void *job, int64_t begin, int64_t end, int part) {
    const Attention *a = job;
    const StepModel *m = a->m;
    const StepLayer *L = a->L;
    const int64_t H = m->n_heads, G = m->n_kv_heads, D = m->head_dim, width = (H + 2 * G) * D, group = H / G;
    const int64_t elem = m->kv_dtype == KV_FLOAT32 ? 4 : 2, stride = G * D;
    float *room = a->scores + part * a->scores_per_part;
    for (int64_t rg = begin; rg < end; rg++) {
        const int64_t r = rg / G, g = rg % G, p = a->positions[r];
        const int64_t first = L->window > 0 && p - L->window + 1 > 0 ? p - L->window + 1 : 0;
        const int64_t base = a->slots[r] * m->ctx * stride * elem + g * D * elem;
        attend(a->qkv + r * width + g * group * D, group, (const char *)L->k_cache + base,
               (const char *)L->v_cache + base, m->kv_dtype, stride, first, p + 1 - first, D, (float)m->scale,
               L->sinks ? L->sinks + g * group : NULL, room, a->attn + r * H * D + g * group * D);
    }
}

/* Attention of a layer for every row: q/k norms, RoPE, the row's K/V written at its position, then each query
   K/V head's query heads over its keys (each (row, K/V head) within one part). */
KERNEL static void attention(const StepModel *m, const StepLayer *L, int64_t M, const int64_t *slots,
                             const int64_t *positions, const float *cos, const float *sin, float *qkv, float *attn,
                             float *scores, int64_t scores_per_part, int threads) {
    const int64_t H = m->n_heads, G = m->n_kv_heads, D = m->head_dim, R = m->rotary_dim, width = (H + 2 * G) * D;
    const int64_t elem = m->kv_dtype == KV_FLOAT32 ? 4 : 2, stride = G * D;
    for (int64_t r = 0; r < M; r++) {
        float *row = qkv + r * width;
        const int64_t p = positions[r];
        for (int64_t h = 0; h < H + G; h++) {
            if (L->qk_norm) rms_norm(row + h * D, L->qk_norm + h * D, D, (float)m->eps, row + h * D);
            rope(row + h * D, cos + p * R, sin + p * R, R);
        }
        const int64_t at = (slots[r] * m->ctx + p) * stride * elem;
        store_kv((char *)L->k_cache + at, row + H * D, stride, m->kv_dtype);
        store_kv((char *)L->v_cache + at, row + (H + G) * D, stride, m->kv_dtype);
    }
    Attention job = {m, L, slots, positions, qkv, attn, scores, scores_per_part};
    parallel_for(M * G, threads, attention_part, &job);
}

/* Logits [M, vocab] of M one-token rows: x [M, hidden] holds their embeddings (overwritten), slots and positions
   say where each row's K/V goes; rope holds the RoPE tables' rows ([> max position, rotary_dim] each): cos, sin, then the
   local layers' cos and sin (the same pointers again for a model without local layers); hidden, unless NULL, gets
   the rows after the final norm [M, hidden]. Returns 0, -1 when memory ran out, -2 when the shapes are outside what
   this code handles. */
EXPORT KERNEL int decode_step(const StepModel *m, int64_t M, const int64_t *slots, const int64_t *positions,
                              const float *const *rope, float *x, float *logits, float *hidden, int threads) {
    const int64_t E = m->hidden, I = m->inter, H = m->n_heads, G = m->n_kv_heads, D = m->head_dim;
    const int64_t width = (H + 2 * G) * D;
    if (D % 8 || D > MAX_HEAD_DIM || E % 32 || I % 32 || G <= 0 || H % G || H / G * D > MAX_GROUP_WIDTH) return -2;
    if (m->rotary_dim <= 0 || m->rotary_dim > D || m->rotary_dim % 2) return -2;
    for (int64_t l = 0; l < m->n_layers; l++) {  /* K-quant rows take whole blocks of 256 values */
        const int64_t *kinds = m->layers[l].kinds, in[4] = {E, H * D, E, I};
        for (int p = 0; p < 4; p++)
            if ((kinds[p] == ROWS_Q4_K || kinds[p] == ROWS_Q6_K) && in[p] % 256) return -2;
    }
    int64_t longest = 1;
    for (int64_t r = 0; r < M; r++) longest = positions[r] + 1 > longest ? positions[r] + 1 : longest;
    const int64_t rooms = threads > 0 ? threads : 1;  /* a part's scores room each (parallel.h: parts <= threads) */
    const int64_t per_part = H / G * ((longest + 7) & ~(int64_t)7);
    float *h = malloc(sizeof(float) * M * (E > I ? E : I));
    float *qkv = malloc(sizeof(float) * M * width);
    float *attn = malloc(sizeof(float) * M * H * D);
    float *gate_up = malloc(sizeof(float) * M * 2 * I);
    float *delta = malloc(sizeof(float) * M * E);
    float *scores = malloc(sizeof(float) * rooms * per_part);
    int status = -1;
    if (!h || !qkv || !attn || !gate_up || !delta || !scores) goto done;
    const float eps = (float)m->eps;
    for (int64_t l = 0; l < m->n_layers; l++) {
        const StepLayer *L = &m->layers[l];
        for (int64_t r = 0; r < M; r++) rms_norm(x + r * E, L->attn_norm, E, eps, h + r * E);
        if (product_of(L->kinds[0])(h, M, E, L->wqkv, width, qkv, threads)) goto done;
        if (L->bqkv)
            for (int64_t r = 0; r < M; r++) add_rows(qkv + r * width, L->bqkv, width);
        const float *const *table = rope + (L->local ? 2 : 0);
        attention(m, L, M, slots, positions, table[0], table[1], qkv, attn, scores, per_part, threads);
        if (product_of(L->kinds[1])(attn, M, H * D, L->wo, E, delta, threads)) goto done;
        if (L->bo)
            for (int64_t r = 0; r < M; r++) add_rows(delta + r * E, L->bo, E);
        if (L->post_attn_norm)
            for (int64_t r = 0; r < M; r++) rms_norm(delta + r * E, L->post_attn_norm, E, eps, delta + r * E);
        add_rows(x, delta, M * E);
        for (int64_t r = 0; r < M; r++) rms_norm(x + r * E, L->mlp_norm, E, eps, h + r * E);
        if (L->experts) {
            if ((status = experts_mlp(L->experts, M, E, h, delta, threads))) goto done;
            status = -1;
        } else {
            if (product_of(L->kinds[2])(h, M, E, L->w_gate_up, 2 * I, gate_up, threads)) goto done;
            for (int64_t r = 0; r < M; r++) gated(gate_up + r * 2 * I, I, m->activation, h + r * I);
            if (product_of(L->kinds[3])(h, M, I, L->w_down, E, delta, threads)) goto done;
        }
        if (L->post_mlp_norm)
            for (int64_t r = 0; r < M; r++) rms_norm(delta + r * E, L->post_mlp_norm, E, eps, delta + r * E);
        add_rows(x, delta, M * E);
    }
    for (int64_t r = 0; r < M; r++) rms_norm(x + r * E, m->norm, E, eps, h + r * E);
    if (hidden) memcpy(hidden, h, sizeof(float) * M * E);  /* the rows the logits are taken from (--spec mtp reads them) */
    if (product_of(m->head_kind)(h, M, E, m->head, m->vocab, logits, threads)) goto done;
    status = 0;
done:
    free(h); free(qkv); free(attn); free(gate_up); free(delta); free(scores);
    return status;
}

/* The layout of the structs Python fills in, for engine/model/native_decode.py to compare with its ctypes mirrors
   before the first step (a field added on one side only, or another compiler's padding, would otherwise be read
   as garbage): each struct's size (field ""), then each field's offset and size, up to an entry without a type. */
typedef struct {
    const char *type, *field;
    int64_t offset, size;
} Field;

#define SIZE_OF(T) {#T, "", 0, (int64_t)sizeof(T)}
#define FIELD(T, f) {#T, #f, (int64_t)offsetof(T, f), (int64_t)sizeof(((T *)0)->f)}

static const Field layout[] = {
    SIZE_OF(StepModel), FIELD(StepModel, n_layers), FIELD(StepModel, hidden), FIELD(StepModel, inter),
    FIELD(StepModel, n_heads), FIELD(StepModel, n_kv_heads), FIELD(StepModel, head_dim), FIELD(StepModel, ctx),
    FIELD(StepModel, vocab), FIELD(StepModel, kv_dtype), FIELD(StepModel, head_kind), FIELD(StepModel, activation),
    FIELD(StepModel, eps), FIELD(StepModel, scale), FIELD(StepModel, layers), FIELD(StepModel, norm),
    FIELD(StepModel, head), FIELD(StepModel, rotary_dim),
    SIZE_OF(StepLayer), FIELD(StepLayer, attn_norm), FIELD(StepLayer, mlp_norm), FIELD(StepLayer, wqkv),
    FIELD(StepLayer, bqkv), FIELD(StepLayer, wo), FIELD(StepLayer, w_gate_up), FIELD(StepLayer, w_down),
    FIELD(StepLayer, qk_norm), FIELD(StepLayer, post_attn_norm), FIELD(StepLayer, post_mlp_norm),
    FIELD(StepLayer, k_cache), FIELD(StepLayer, v_cache), FIELD(StepLayer, window), FIELD(StepLayer, local),
    FIELD(StepLayer, kinds), FIELD(StepLayer, experts), FIELD(StepLayer, sinks), FIELD(StepLayer, bo),
    SIZE_OF(StepExperts), FIELD(StepExperts, n_experts), FIELD(StepExperts, top_k), FIELD(StepExperts, inter),
    FIELD(StepExperts, shared_inter), FIELD(StepExperts, routing), FIELD(StepExperts, router),
    FIELD(StepExperts, gate_up), FIELD(StepExperts, down), FIELD(StepExperts, shared_gate_up),
    FIELD(StepExperts, shared_down), FIELD(StepExperts, kinds), FIELD(StepExperts, router_bias),
    FIELD(StepExperts, gate_up_bias), FIELD(StepExperts, down_bias), FIELD(StepExperts, swiglu_limit),
    FIELD(StepExperts, swiglu_alpha), FIELD(StepExperts, expert_bias), FIELD(StepExperts, norm_eps),
    FIELD(StepExperts, routed_scaling), FIELD(StepExperts, norm_topk), FIELD(StepExperts, n_group),
    FIELD(StepExperts, topk_group), FIELD(StepExperts, shared_gated),
    {0, 0, 0, 0},
};

EXPORT const Field *step_layout(void) { return layout; }
