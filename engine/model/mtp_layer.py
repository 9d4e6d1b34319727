"""A next-token (MTP) layer (GLM-4.x MoE, DeepSeek-V3, GLM-4.7-Flash, Qwen3-Next, Qwen3.5), runnable: built from
the tensors the loaders keep (`CausalLM.mtp`, `HybridCausalLM.mtp`, mtp.py).

For the row of position t it takes the target's hidden state at t (after the final norm: the row its logits are
taken from) and the token at t+1, and predicts the token at t+2:

    x = eh_proj([enorm(embed(token_{t+1})); hnorm(hidden_t)])
    x = decoder_layer(x)            # attention over its own K/V of the earlier rows (RoPE at position t), then MoE
                                    # (the attention of the model's kind: per-head, latent or gated,
                                    # mtp_attention.py; the MLP the layer's: experts, or Qwen3.5's dense one)
    logits = head(shared_head.norm(x))

as llama.cpp's glm4-moe nextn graph computes it (its `t_h_nextn`: the target's rows after `output_norm`, the
layer's own after `shared_head.norm`), and its qwen3next MTP graph too (the same order and rows, the gated
attention of the hybrid's own layers, a dense MLP where Qwen3.5 has one). The embedding and the head are the
MTP layer's own where the file holds them (`nextn.embed_tokens`, `nextn.shared_head_head`), else the model's. The layer's output row after
`shared_head.norm` is the hidden state its next step takes in place of the target's (drafting further ahead).

The layer runs on the CPU in float32: the draft runs one row per step. Its experts (routed and shared) are held
as the main model's CPU experts when the model's weights are int4 on the CPU (`int4_experts`: the file's K-quant
blocks or 4-bit groups, mtp_experts.py), float32 with `--cpu-weights float`; every other tensor is decoded when
the block reads it, one at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError
from engine.model import int4, mla, moe, moe_loading, mtp_experts
from engine.model.hybrid.config import HybridConfig
from engine.model.mtp_attention import CPU, GatedAttention, HeadAttention, LatentAttention
from engine.model.norms import rms_norm
from engine.model.projections import logit_rows
from engine.model.quant_embedding import embed_rows

if TYPE_CHECKING:
    from engine.model.config import ModelConfig
    from engine.model.hybrid.model import HybridCausalLM
    from engine.model.llama import CausalLM
    from engine.model.mtp import MtpLayer

# The families whose files carry next-token layers this runs: GLM-4.x MoE (per-head K/V), DeepSeek-V3 and
# GLM-4.7-Flash (latent attention; llama.cpp's deepseek2 files load as deepseek_v3), Qwen3-Next and Qwen3.5 (the
# hybrids' gated attention).
ARCHITECTURES = ("glm4_moe", "deepseek_v3", "glm4_moe_lite", "qwen3_next", "qwen3_5", "qwen3_5_moe")


class MtpBlock:
    """One next-token layer on the CPU, float32 but for its experts with `int4_experts` (then held as the main
    model's CPU experts: the file's K-quant blocks or 4-bit groups); its K/V rows live in caches the caller owns
    ([rows, *kv_shape]). Its attention is the kind the model's layers have (mtp_attention.py): per-head K/V,
    latent or gated attention."""

    def __init__(self, model: CausalLM | HybridCausalLM, layer: MtpLayer, index: int = 0, *,
                 int4_experts: bool = False) -> None:
        c: ModelConfig | HybridConfig = model.config
        if c.architecture not in ARCHITECTURES:
            raise ModelLoadError(f"next-token layers run for {', '.join(ARCHITECTURES)} only, not {c.architecture}")
        self.config = c
        self.index = c.n_layers + index  # the layer's number in the file (its MoE keys)
        self.eps = c.rms_norm_eps
        prefix = f"{self.index}."
        decoded = mtp_experts.decoder(layer, prefix)  # each tensor decoded when read: no float copy of them all
        h = c.hidden_size
        where = f"next-token layer {self.index}"

        def kept(key: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
            return decoded(key)

        get: mla.Getter = kept
        # the loaders' own reading of latent attention: RoPE rows to rotate-half order, a split kv_b joined
        if not isinstance(c, HybridConfig) and c.mla is not None:
            get, _ = mla.rope_rows_in_halves(c.mla, c.n_heads, mla.kv_b_joined(kept))

        def need(key: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = get(f"{self.index}.{key}", CPU, torch.float32)
            if t is None:
                raise ModelLoadError(f"{where}: the tensor {key} is missing")
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"{where}: {key} has shape {tuple(t.shape)}, expected {shape}")
            return t

        self.eh_proj = need("nextn.eh_proj", (h, 2 * h))
        self.enorm, self.hnorm = need("nextn.enorm", (h,)), need("nextn.hnorm", (h,))
        self.head_norm = need("nextn.shared_head_norm", (h,))
        self.attn_norm, self.mlp_norm = need("attn_norm", (h,)), need("mlp_norm", (h,))
        self.attention: HeadAttention | LatentAttention | GatedAttention
        rotary = model.rotary
        assert rotary is not None, "the families with next-token layers rotate"
        if isinstance(c, HybridConfig):
            self.attention = GatedAttention(c, need, rotary)
        else:
            self.attention = HeadAttention(c, need) if c.mla is None else LatentAttention(c, need, rotary)
        self.wo = need("o", (h, self.attention.out_width))
        self.moe: moe.SparseMoe | None = None
        self.gate_up = self.down = torch.empty(0)
        if c.is_moe_layer(self.index):
            def moe_need(key: str, shape: tuple[int, ...]) -> torch.Tensor:
                return need(key.split(".", 1)[1], shape)

            # As the main model's CPU experts (build.py): a K-quant stack stays in its blocks, a Q4 one gives
            # its own groups, the rest is quantised expert by expert; the shared expert then as 4-bit groups.
            packed = int4_experts and int4.available()
            self.moe = moe_loading.build_sparse_moe(
                c, self.index, decoded, moe_need, lambda t: t, where,
                groups=mtp_experts.groups(layer, prefix, where) if packed else None,
                kquant=mtp_experts.kquant(layer, prefix) if packed else None)
            if packed:
                self.moe.quantize_experts()
        elif isinstance(c, HybridConfig):  # Qwen3.5 (dense): the layer's MLP is its decoder layers' SwiGLU
            inter = c.intermediate_size
            self.gate_up = torch.cat((need("gate", (inter, h)), need("up", (inter, h))))
            self.down = need("down", (h, inter))
        else:
            raise ModelLoadError(f"{where}: expected a MoE layer (first_k_dense_replace covers it)")
        # The MTP layer's own embedding and head where the file holds them, else the model's (as llama.cpp).
        self.embed = decoded(f"{self.index}.nextn.embed_tokens")
        self.model_embed, self.embed_scale = model.embed, model.embed_scale
        self.head = decoded(f"{self.index}.nextn.shared_head_head")
        self.model_head = model.lm_head
        self.kv_shape = self.attention.kv_shape

    def new_cache(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty K and V rows for one sequence of up to `rows` positions."""
        return (torch.zeros(rows, *self.kv_shape), torch.zeros(rows, *self.kv_shape))

    @torch.no_grad()
    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, start: int,
                cache: tuple[torch.Tensor, torch.Tensor], first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, vocab] (float32) for the tokens at start+2 .. start+n+1, and the layer's output rows [n, h]
        after `shared_head.norm` (what a next step takes as its hidden rows),
        from `next_ids` (the tokens at start+1 ..) and `hidden` (the target's, or this layer's, rows at start ..).
        Writes the K/V rows of positions start .. start+n-1 into `cache` and attends to its rows from `first`
        before them (a later `first`: a context cut short, for rows whose earlier hidden rows are not at hand)."""
        n = next_ids.shape[0]
        assert hidden.shape == (n, self.config.hidden_size), ("hidden", tuple(hidden.shape))
        k_cache, v_cache = cache
        if start + n > k_cache.shape[0]:
            raise ValueError(f"next-token layer: positions up to {start + n} do not fit its {k_cache.shape[0]} rows")
        table = self.embed if self.embed is not None else self.model_embed
        e = embed_rows(next_ids.to(self.model_embed.device), table, self.embed_scale).to("cpu", torch.float32)
        x = F.linear(torch.cat((rms_norm(e, self.enorm, self.eps),
                                rms_norm(hidden.to("cpu", torch.float32), self.hnorm, self.eps)), -1), self.eh_proj)
        assert 0 <= first <= start, (first, start)
        attended = self.attention(rms_norm(x, self.attn_norm, self.eps), start, k_cache, v_cache, first)
        x = x + F.linear(attended, self.wo)
        x = x + self._mlp(rms_norm(x, self.mlp_norm, self.eps))
        h = rms_norm(x, self.head_norm, self.eps)
        if self.head is not None:
            return F.linear(h, self.head), h
        head = self.model_head
        return logit_rows(h.to(self.model_embed.device, self.model_embed.dtype), head).float().cpu(), h

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(x, 0)
        inter = self.down.shape[1]
        gate_up = F.linear(x, self.gate_up)
        return F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], self.down)
