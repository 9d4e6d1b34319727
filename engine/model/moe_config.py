"""The expert settings of a mixture-of-experts model (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, GraniteMoE,
GLM-4.x MoE, gpt-oss; and Gemma 4's expert block beside its dense MLP, engine/model/gemma4_experts.py).

Kept apart from config.py so the dense families' shape stays as it was: a dense ModelConfig has `moe=None` and
describes itself exactly as before; a MoE one carries a MoeConfig, which is part of the identity of its K/V.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.model import families

MOE_ARCHITECTURES = families.names("moe")

# How router logits become (experts, weights):
#   softmax_topk: softmax over all experts in float32, then top-k of the probabilities, optionally renormalised
#                 over the chosen k (Qwen*, OLMoE; Mixtral always renormalises).
#   topk_softmax: top-k of the logits, then softmax over those k (GraniteMoE; gpt-oss, whose router adds a bias).
#   sigmoid_bias: sigmoid of the logits in float32; the top-k experts by sigmoid + a per-expert bias (the bias
#                 only chooses: zero when the family has none); weights = the chosen sigmoids, divided by their
#                 sum (+ norm_eps) when norm_topk_prob, times routed_scaling (LFM2-MoE). With n_group > 1 the
#                 experts are chosen only among the topk_group groups (of n_experts / n_group consecutive
#                 experts) whose two best sigmoid + bias values sum highest (GLM-4.x MoE, Nemotron-H).
ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_bias")
# The gate's activation of an expert's gated MLP, down(act(gate x) * up x): SiLU (SwiGLU) in every family but
# Gemma 4, whose experts are GeGLU with the tanh GeLU.
ACTIVATIONS = ("silu", "gelu_tanh")
# Fields a family without them leaves at these defaults; describe() omits them then, so the identity of the
# parked K/V of the families from before them stays what it was.
_OPTIONAL_DEFAULTS = {"routed_scaling": 1.0, "norm_eps": 0.0, "n_group": 1, "topk_group": 1, "shared_gated": True,
                      "router_bias": False, "expert_biases": False, "swiglu_limit": None, "swiglu_alpha": None,
                      "activation": "silu"}


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Experts per layer, how tokens are routed to them, and the family's extras."""

    n_experts: int
    top_k: int
    expert_size: int  # intermediate size of one expert
    routing: str
    norm_topk_prob: bool
    shared_expert_size: int = 0  # an always-on expert of this size beside the routed ones; 0 = none
    shared_gated: bool = True  # the shared expert's output times a sigmoid gate (Qwen2-MoE); False: added as
    # it is (GLM-4.x MoE)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP of ModelConfig.intermediate_size (Qwen's
    # mlp_only_layers / decoder_sparse_step)
    # GraniteMoE's scalars (1.0 elsewhere); the loader folds them into the weights, the forward never sees them.
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None  # the softmax scale; None = 1/sqrt(head_dim)
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # sigmoid_bias routing: the chosen weights' scale and the term added to their sum when renormalised
    routed_scaling: float = 1.0
    norm_eps: float = 0.0
    # sigmoid_bias routing by groups: experts come from the best `topk_group` of `n_group` groups (1, 1: all)
    n_group: int = 1
    topk_group: int = 1
    # gpt-oss: the router's logits have a bias; each expert's gate, up and down projections have biases; and
    # its SwiGLU is clamped: gate <= limit, -limit <= up <= limit, out = (up + 1) * gate * sigmoid(alpha * gate)
    # (None, None: the plain down(silu(gate) * up) of every other family).
    router_bias: bool = False
    expert_biases: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    activation: str = "silu"  # the gate's activation (ACTIVATIONS)

    @property
    def clamped_swiglu(self) -> bool:
        """Whether the experts run gpt-oss's clamped SwiGLU (swiglu_limit, swiglu_alpha) instead of SiLU's."""
        return self.swiglu_limit is not None

    def describe(self) -> dict[str, Any]:
        """JSON-able description (part of the model's, and so of its parked K/V's, identity)."""
        out = asdict(self)
        for name, default in _OPTIONAL_DEFAULTS.items():
            if out[name] == default:
                del out[name]
        out["dense_layers"] = list(self.dense_layers)
        return out

    def check(self, n_layers: int) -> None:
        """ValueError saying what is wrong when these settings cannot describe a model of `n_layers` layers."""
        for name in ("n_experts", "top_k", "expert_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive whole number, got {value!r}")
        if self.top_k > self.n_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the number of experts ({self.n_experts})")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing {self.routing!r}: expected one of {', '.join(ROUTINGS)}")
        if not self.routed_scaling > 0:
            raise ValueError(f"routed_scaling_factor: expected a positive number, got {self.routed_scaling!r}")
        if self.shared_expert_size < 0:
            raise ValueError(f"shared_expert_size: expected 0 or more, got {self.shared_expert_size}")
        if self.n_group != 1 or self.topk_group != 1:
            if self.routing != "sigmoid_bias":
                raise ValueError(f"n_group {self.n_group}: expert groups need sigmoid routing, not {self.routing}")
            if not isinstance(self.n_group, int) or self.n_group <= 0 or self.n_experts % self.n_group:
                raise ValueError(f"n_group: expected a positive divisor of the {self.n_experts} experts, "
                                 f"got {self.n_group!r}")
            if self.n_experts // self.n_group < 2:
                raise ValueError(f"n_group {self.n_group}: each group needs at least 2 experts (a group is ranked "
                                 f"by its two best), got {self.n_experts} experts")
            if not isinstance(self.topk_group, int) or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group: expected 1 to n_group ({self.n_group}), got {self.topk_group!r}")
            if self.top_k > self.topk_group * (self.n_experts // self.n_group):
                raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the experts of the topk_group "
                                 f"({self.topk_group}) groups kept ({self.topk_group * (self.n_experts // self.n_group)})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.activation!r}: expected one of {', '.join(ACTIVATIONS)}")
        if self.activation != "silu" and self.clamped_swiglu:
            raise ValueError("the clamped SwiGLU is a SiLU gate: expected activation silu with swiglu_limit")
        if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
            raise ValueError("swiglu_limit and swiglu_alpha: expected both (a clamped SwiGLU) or neither")
        if self.expert_biases != self.clamped_swiglu:
            raise ValueError("expert biases come with the clamped SwiGLU (gpt-oss's experts): expected both or neither")
        for name in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, float) or not value > 0):
                raise ValueError(f"{name}: expected a positive number, got {value!r}")
        bad = [i for i in self.dense_layers if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"dense layers {bad} are outside the model's {n_layers} layers")


def moe_from_hf(arch: str, cfg: dict[str, Any]) -> MoeConfig:
    """The expert settings in an HF config.json of `arch`; ValueError naming what is missing or unsupported.

    Defaults for keys a config may leave out are those of transformers' config class for the family.
    """
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r}: only silu experts are supported")
    n_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if not n_experts:
        raise ValueError("the number of experts (num_experts, num_local_experts or n_routed_experts) is missing")
    top_k = cfg.get("num_experts_per_tok")
    if not top_k:
        raise ValueError("num_experts_per_tok is missing")
    common: dict[str, Any] = {"n_experts": int(n_experts), "top_k": int(top_k)}
    n_layers = int(cfg["num_hidden_layers"])
    if arch in ("qwen3_moe", "qwen2_moe"):
        step = int(cfg.get("decoder_sparse_step", 1))
        only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        if step <= 0:
            raise ValueError(f"decoder_sparse_step: expected a positive whole number, got {step}")
        dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "qwen2_moe" else 0
        if arch == "qwen2_moe" and shared <= 0:
            raise ValueError("shared_expert_intermediate_size is missing (Qwen2-MoE layers have a shared expert)")
        return MoeConfig(**common, expert_size=int(cfg["moe_intermediate_size"]), routing="softmax_topk",
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), shared_expert_size=shared,
                         dense_layers=dense)
    if arch in ("glm4_moe", "deepseek_v3", "glm4_moe_lite"):  # the same expert block; defaults differ
        return _glm4_moe(cfg, common, n_layers, _SIGMOID_DEFAULTS[arch])
    if arch == "gpt_oss":
        return gpt_oss_experts(common, int(cfg["intermediate_size"]), cfg.get("swiglu_limit", 7.0),
                               cfg.get("swiglu_alpha", 1.702))
    expert_size = int(cfg["intermediate_size"])
    if arch == "olmoe":
        if cfg.get("clip_qkv") is not None:
            raise ValueError(f"clip_qkv {cfg['clip_qkv']!r}: clipping q/k/v is not supported (expected null)")
        return MoeConfig(**common, expert_size=expert_size, routing="softmax_topk",
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if arch == "mixtral":
        return MoeConfig(**common, expert_size=expert_size, routing="softmax_topk", norm_topk_prob=True)
    if arch == "granitemoe":
        return MoeConfig(
            **common, expert_size=expert_size, routing="topk_softmax", norm_topk_prob=False,
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
            attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
            logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        )
    raise ValueError(f"{arch}: not a mixture-of-experts architecture ({', '.join(MOE_ARCHITECTURES)})")


# The defaults of transformers' config classes for keys a config.json may leave out: first_k_dense_replace,
# n_group, topk_group, routed_scaling_factor.
_SIGMOID_DEFAULTS = {"glm4_moe": (1, 1, 1, 1.0), "deepseek_v3": (3, 8, 4, 2.5), "glm4_moe_lite": (1, 1, 1, 1.8)}


def _glm4_moe(cfg: dict[str, Any], common: dict[str, Any], n_layers: int,
              defaults: tuple[int, int, int, float]) -> MoeConfig:
    """GLM-4.x MoE, DeepSeek-V3 and GLM-4.7-Flash (transformers' Glm4MoeConfig, DeepseekV3Config,
    Glm4MoeLiteConfig): the first `first_k_dense_replace` layers (Glm4MoeLiteConfig: those `mlp_layer_types`
    names "dense") dense, sigmoid routing with the score-correction bias among the best `topk_group` of `n_group` groups,
    weights renormalised (+1e-20, as transformers adds) and times `routed_scaling_factor`, and `n_shared_experts`
    experts of `moe_intermediate_size` as one shared expert added without a gate."""
    first_dense = cfg.get("first_k_dense_replace", defaults[0])
    if not isinstance(first_dense, int) or not 0 <= first_dense <= n_layers:
        raise ValueError(f"first_k_dense_replace: expected 0 to {n_layers} (the layers), got {first_dense!r}")
    dense = tuple(range(first_dense))
    kinds = cfg.get("mlp_layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != n_layers or not set(kinds) <= {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types: expected \"dense\" or \"sparse\" for each of the {n_layers} layers, "
                             f"got {kinds!r}")
        dense = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    n_shared = cfg.get("n_shared_experts", 1)
    if not isinstance(n_shared, int) or n_shared < 0:
        raise ValueError(f"n_shared_experts: expected a whole number >= 0, got {n_shared!r}")
    expert_size = int(cfg.get("moe_intermediate_size", 1408))
    return MoeConfig(**common, expert_size=expert_size, routing="sigmoid_bias",
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), shared_expert_size=n_shared * expert_size,
                     shared_gated=False, dense_layers=dense,
                     routed_scaling=float(cfg.get("routed_scaling_factor", defaults[3])), norm_eps=1e-20,
                     n_group=int(cfg.get("n_group") or defaults[1]), topk_group=int(cfg.get("topk_group") or defaults[2]))


def gpt_oss_experts(common: dict[str, Any], expert_size: int, limit: Any, alpha: Any) -> MoeConfig:
    """gpt-oss (transformers' GptOssConfig; llama.cpp's LLM_ARCH_OPENAI_MOE): every layer's MLP is experts of
    `intermediate_size`, chosen by top-k of the biased router logits and weighted by the softmax over those k;
    experts with biases and the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`; 7.0 and 1.702 by default, the
    values llama.cpp builds in)."""
    for name, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}: expected a positive number, got {value!r}")
    return MoeConfig(**common, expert_size=expert_size, routing="topk_softmax", norm_topk_prob=False,
                     router_bias=True, expert_biases=True, swiglu_limit=float(limit), swiglu_alpha=float(alpha))
