/* A layer's sparse experts in the native decode step (experts.c; engine/model/native_decode.py mirrors
   StepExperts field for field). */
#ifndef STRATA_EXPERTS_H
#define STRATA_EXPERTS_H
#include <stdint.h>

/* How router logits become a row's experts and weights (engine/model/moe_config.py's routings): a softmax over all
   experts then the top k probabilities, those renormalised to sum to 1, or the top k logits then a softmax over
   them; or (GLM-4.x MoE, DeepSeek-V3) each logit's sigmoid, the top k of sigmoid + expert_bias within the best
   topk_group of n_group groups, weighted by their sigmoids (renormalised when norm_topk) times routed_scaling. */
enum { SOFTMAX_TOPK = 0, SOFTMAX_TOPK_NORM = 1, TOPK_SOFTMAX = 2, SIGMOID_BIAS = 3 };

typedef struct {
    int64_t n_experts, top_k, inter, shared_inter, routing;  /* shared_inter 0: no shared expert */
    const float *router;              /* [n_experts (+ 1: a gated shared expert's gate), hidden], float32 */
    const uint8_t *const *gate_up;    /* per expert: rows [2 inter, hidden], the gate's rows then the up's */
    const uint8_t *const *down;       /* per expert: rows [hidden, inter] */
    const uint8_t *shared_gate_up, *shared_down;  /* the shared expert's rows, or NULL */
    int64_t kinds[4];                 /* ROWS_* (blocks.h) of gate_up, down, shared_gate_up, shared_down */
    /* gpt-oss: a bias on the router's logits [n_experts], each expert's gate/up [n_experts, 2 inter] and down
       [n_experts, hidden] biases, and its clamped SwiGLU (swiglu_limit 0: the plain SwiGLU); NULL where none. */
    const float *router_bias, *gate_up_bias, *down_bias;
    double swiglu_limit, swiglu_alpha;
    /* SIGMOID_BIAS routing: the bias added to the sigmoids to choose [n_experts] (or NULL), the weights' sum's
       epsilon and factor, whether they are renormalised, and the groups */
    const float *expert_bias;
    double norm_eps, routed_scaling;
    int64_t norm_topk, n_group, topk_group;
    int64_t shared_gated;             /* 1: the shared expert's output times the sigmoid of the router's last row */
} StepExperts;

int experts_mlp(const StepExperts *x, int64_t M, int64_t hidden, const float *h, float *out, int threads);

#endif
