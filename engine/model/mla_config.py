"""The latent-attention settings of a multi-head latent attention (MLA) model: DeepSeek-V3 (`deepseek_v3`) and
GLM-4.7-Flash-class (`glm4_moe_lite`).

MLA projects each token to one compressed latent shared by every head: `c_kv` (`kv_lora_rank` values, after
an RMSNorm) and a RoPE'd key part `k_pe` (`qk_rope_head_dim` values). A head's key is [k_nope | k_pe] with
k_nope = W_uk c_kv, its value W_uv c_kv (W_uk, W_uv: the rows of `kv_b_proj`). The K/V store keeps the latent
alone, `latent_width` values a token a layer instead of 2 x heads x head widths (engine/model/mla.py).

A leaf module (it imports nothing of the engine), so config.py can import it without a circle.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

# HF tensor names of an MLA layer's attention -> canonical keys (build.py reads them; "o" is the Llama one).
HF_NAMES = {
    "self_attn.q_a_proj.weight": "q_a", "self_attn.q_a_layernorm.weight": "q_a_norm",
    "self_attn.q_b_proj.weight": "q_b", "self_attn.kv_a_proj_with_mqa.weight": "kv_a",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm", "self_attn.kv_b_proj.weight": "kv_b",
}
# llama.cpp's deepseek2 tensor names -> canonical keys. Recent converters split kv_b into attn_k_b (each head's
# W_uk transposed: [heads, kv_lora_rank, qk_nope]) and attn_v_b ([heads, v_head_dim, kv_lora_rank]); older files
# hold attn_kv_b as HF does (mla.kv_b_joined reads either).
GGUF_NAMES = {
    "attn_q_a.weight": "q_a", "attn_q_a_norm.weight": "q_a_norm", "attn_q_b.weight": "q_b",
    "attn_kv_a_mqa.weight": "kv_a", "attn_kv_a_norm.weight": "kv_a_norm", "attn_kv_b.weight": "kv_b",
    "attn_k_b.weight": "k_b", "attn_v_b.weight": "v_b",
}
# transformers' DeepseekV3RMSNorm / Glm4MoeLiteRMSNorm of q_a and of c_kv are built with their default eps, not
# the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class MlaConfig:
    """The shapes of a latent-attention layer and its softmax scale."""

    kv_lora_rank: int  # width of the compressed latent c_kv
    qk_nope_head_dim: int  # a head's key and query channels without RoPE
    qk_rope_head_dim: int  # a head's RoPE'd channels (the key part shared by all heads)
    v_head_dim: int  # a head's value width
    q_lora_rank: int | None  # None: q straight from the hidden state (q_proj); else q_a -> norm -> q_b
    rope_interleave: bool  # the file's RoPE channels are in interleaved pairs (loaders reorder them to halves)
    softmax_scale: float  # (nope + rope)^-1/2, times YaRN's mscale(factor, mscale_all_dim)^2 when set

    @property
    def latent_width(self) -> int:
        """Values a token keeps per layer: c_kv then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def store_width(self) -> int:
        """The K/V store's head width for one latent: the latent's first half is stored as the "K" row, the rest
        (zero-padded to the same width when odd) as the "V" row, so a token costs latent_width values, not two."""
        return (self.latent_width + 1) // 2

    def q_rows(self, n_heads: int) -> int:
        """Rows of the first query projection (q_a, or q itself without a q LoRA)."""
        return self.q_lora_rank if self.q_lora_rank is not None else n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)

    def check(self) -> None:
        """ValueError naming the setting when these shapes cannot describe an MLA layer."""
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive whole number, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even number (RoPE turns pairs), got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"q_lora_rank: expected a positive whole number or null, got {self.q_lora_rank!r}")

    def describe(self) -> dict[str, Any]:
        """JSON-able description (part of the model's, and so of its parked latents', identity)."""
        return {**asdict(self), "stored": "latent"}


def mla_from_hf(cfg: dict[str, Any], rope_scaling: dict | None) -> MlaConfig:
    """The latent-attention settings in an HF config.json (defaults: DeepseekV3Config's); ValueError naming
    what this engine does not run."""
    quant = cfg.get("quantization_config")
    if quant:  # DeepSeek-V3's released weights: FP8 blocks with scales in separate tensors
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"quantization_config {method!r}: quantised checkpoints are not read (their scales would be "
                         "ignored); use a bfloat16 conversion or a GGUF")
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias true: biases on the latent projections are not supported (expected false)")
    nope, rope = int(cfg.get("qk_nope_head_dim", 128)), int(cfg.get("qk_rope_head_dim", 64))
    q_lora = cfg.get("q_lora_rank", 1536)
    scale = (nope + rope) ** -0.5
    if rope_scaling is not None and rope_scaling.get("rope_type") == "yarn" and rope_scaling.get("mscale_all_dim"):
        # transformers' yarn_apply_mscale: MLA scales q.k by YaRN's mscale of every channel, squared
        factor = float(rope_scaling["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(rope_scaling["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    mla = MlaConfig(kv_lora_rank=int(cfg.get("kv_lora_rank", 512)), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                    v_head_dim=int(cfg.get("v_head_dim", 128)), q_lora_rank=None if q_lora is None else int(q_lora),
                    rope_interleave=bool(cfg.get("rope_interleave", True)), softmax_scale=scale)
    mla.check()
    return mla


def mla_from_gguf(meta: dict[str, Any], arch: str, rope_scaling: dict | None) -> MlaConfig:
    """The latent-attention settings of a llama.cpp `deepseek2` file: `attention.kv_lora_rank`,
    `attention.q_lora_rank` (absent: a direct q projection), `rope.dimension_count`, and a head's key and value
    widths from `attention.key_length_mla` / `value_length_mla` (older files: `key_length` / `value_length`,
    which newer ones use for the latent). RoPE rows are in interleaved pairs, as llama.cpp runs the family."""

    def need(name: str) -> int:
        value = meta.get(f"{arch}.{name}")
        if value is None:
            raise ValueError(f"metadata {arch}.{name} is missing")
        return int(value)

    rank, rope = need("attention.kv_lora_rank"), need("rope.dimension_count")
    mla_keys = f"{arch}.attention.key_length_mla" in meta
    key_width = need("attention.key_length_mla" if mla_keys else "attention.key_length")
    v_width = need("attention.value_length_mla" if mla_keys else "attention.value_length")
    q_lora = meta.get(f"{arch}.attention.q_lora_rank")
    cfg: dict[str, Any] = {"kv_lora_rank": rank, "qk_rope_head_dim": rope, "qk_nope_head_dim": key_width - rope,
                           "v_head_dim": v_width, "q_lora_rank": None if not q_lora else int(q_lora),
                           "rope_interleave": True}
    return mla_from_hf(cfg, rope_scaling)


def interleaved_to_halves(n: int) -> list[int]:
    """Row order that turns RoPE channels in interleaved pairs (x0, x1), (x2, x3)... into rotate-half order
    [x0, x2, ..., x1, x3, ...]: transformers' apply_rotary_pos_emb_interleave yields exactly that order, so keys
    stored in it are transformers' own."""
    return list(range(0, n, 2)) + list(range(1, n, 2))
