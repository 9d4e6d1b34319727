"""The Llama-family forward pass (Llama, Mistral, Qwen2, Qwen3, SmolLM, Gemma 3) over explicit K/V buffers.

One call runs any mix of chunks from different slots (continuous batching): projections and the MLP run on
the concatenated tokens, attention runs per chunk against that chunk's slot rows.

Batch invariance (a slot's logits do not depend on what it was batched with): the projections' kernels and
their rules are engine/model/projections.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F

from engine.kv import KVBuffers
from engine.model.chunk_attention import (
    AttentionPlans,
    attention_plans,
    decode_attention,
    rope_rows,
    sdpa,
    sink_attention,
)
from engine.model.config import ModelConfig
from engine.model.decoder_layer import DecoderLayer
from engine.model.int4 import Int4Weight
from engine.model.kquant_weight import KQuantWeight
from engine.model.layers import ModelLayers
from engine.model.norms import head_rms_norm, rms_norm
from engine.model.per_layer_inputs import PerLayerInputs, per_layer_residual
from engine.model.projections import linear, logit_rows
from engine.model.q8_weight import Q8Weight
from engine.model.quant_embedding import QuantEmbedding, embed_rows
from engine.model.rope import RotaryTable
from engine.model.sliding import first_key

if TYPE_CHECKING:  # moe and mla import this module's kernels
    from engine.model.mtp import MtpLayer


@dataclass(slots=True)
class SeqChunk:
    """Tokens of one slot to run: K/V for positions [0, start) is already in the slot."""

    slot: int
    start: int
    tokens: torch.Tensor  # 1-D int64


def check_rows(chunks: list[SeqChunk]) -> None:
    """A step holds one chunk per slot, or a slot's one-token rows at consecutive positions (a speculative verify,
    engine/runtime/speculation.py). Every CPU path writes a row's K/V before a later row of the step attends
    (forward_chunks and CpuDecode chunk by chunk, step.c all rows of a layer first), and a row attends only up to
    its own position, so each row computes what the decode step of its token alone computes."""
    last: dict[int, SeqChunk] = {}
    for ch in chunks:
        prev = last.get(ch.slot)
        assert prev is None or (prev.tokens.numel() == 1 and ch.tokens.numel() == 1 and ch.start == prev.start + 1), (
            f"slot {ch.slot}: one chunk per slot per call, or one-token rows at consecutive positions")
        last[ch.slot] = ch


class DecodeRunner(Protocol):
    """What forward_chunks hands a step to first (engine.model.graph_decode.GraphDecode)."""

    # True: the runner's arithmetic is its own (engine/model/native_decode.py), so it computes every one-token
    # row, those of mixed steps and all_logits calls included, and a row's results stay what they are alone.
    owns_one_token_rows: bool

    @property
    def batches(self) -> Sequence[int]:
        """Batch sizes it captures ahead (the engine's warm-up runs each once); empty for one capturing nothing."""

    def run(self, chunks: list[SeqChunk], kv: KVBuffers) -> torch.Tensor | None:
        """Logits [len(chunks), vocab] (float32) of the step, or None to have forward_chunks compute it."""


class CausalLM(torch.nn.Module):
    """A decoder-only language model whose layers may be spread over several devices (stages)."""

    # The buffers registered in __init__, typed (nn.Module's attribute lookup is typed Tensor | Module);
    # int4 replaces the projection weights by Int4Weight ones (build, int4.quantize_model).
    embed: torch.Tensor | QuantEmbedding  # the file's blocks on the CPU (build, quant_embedding.py)
    norm: torch.Tensor
    lm_head: torch.Tensor | Int4Weight | Q8Weight | KQuantWeight  # the file's Q8_0 blocks: engine/model/q8_output.py

    def __init__(
        self,
        config: ModelConfig,
        stages: list[tuple[torch.device, int, int]],
        *,
        description: ModelLayers,
        embed: torch.Tensor,
        layers: list[DecoderLayer],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
        rope_freq_factors: torch.Tensor | None = None,
        per_layer: PerLayerInputs | None = None,
    ) -> None:
        super().__init__()
        assert len(layers) == config.n_layers == len(description.layers), (len(layers), config.n_layers)
        assert all(layer.spec is spec for layer, spec in zip(layers, description.layers, strict=True))
        assert stages and stages[0][1] == 0 and stages[-1][2] == config.n_layers, stages
        self.config = config
        # What every executor reads about the layers (engine/model/layers.py; executors.py says which runs what).
        self.description = description
        self.stages = [(torch.device(d), a, b) for d, a, b in stages]
        self.register_buffer("embed", embed, persistent=False)
        self.layers = torch.nn.ModuleList(layers)
        self.register_buffer("norm", norm, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        # Gemma 4's per-layer input embeddings (per_layer_inputs.py): the table in host RAM, the rest on the first
        # stage's device.
        assert (per_layer is not None) == any(spec.per_layer_input for spec in description.layers)
        self.per_layer = per_layer
        # Partial RoPE: the tables span the rotated channels only (their frequencies are those of that width).
        rotary = {spec.attention.rotary_dim for spec in description.layers}
        assert len(rotary) == 1 and 0 not in rotary, f"one rotary width per model, got {rotary}"
        rotary_dim = rotary.pop()
        # GLM's next-token (MTP) layers as the file holds them, kept for speculative decoding, not run (mtp.py);
        # the loaders set them after building.
        self.mtp: tuple[MtpLayer, ...] = ()
        # `--spec mtp`: given every row's hidden state after the final norm (what its logits are taken from) on the
        # eager path, as
        # (chunks in row order, their row offsets, the rows); the next-token layer drafts from them
        # (engine/runtime/mtp_drafts.py). Reads the rows only: results are those without it.
        self.hidden_rows: Callable[[list[SeqChunk], list[int], torch.Tensor], None] | None = None
        # Gemma 4's global layers (the ones this table rotates when there is a local one) may be wider.
        rotated = rotary_dim or (config.global_head_dim if config.rope_local_theta is not None else None)
        self.rotary = RotaryTable(config if rotated is None else replace(config, head_dim=rotated, rotary_dim=None),
                                  rope_freq_factors)
        # False: projections of a batch run as one GEMM (`linear`'s fast path); the engine clears it on CUDA
        # unless --deterministic. CPU float32 and int4 kernels are batch-invariant either way.
        self.batch_invariant = True
        # A runner of captured decode steps (engine.model.graph_decode.GraphDecode), set by the engine on CUDA;
        # forward_chunks hands it steps of one-token chunks and computes itself what it declines.
        self.graphs: DecodeRunner | None = None
        # Gemma 3's sliding layers rotate with their own, unscaled base.
        self.rotary_local = None
        local = {spec.attention.rope.theta for spec in description.layers if spec.attention.rope.local}
        assert len(local) <= 1, f"one local RoPE base, got {sorted(local)}"
        if local:
            self.rotary_local = RotaryTable(replace(config, rope_theta=local.pop(), rope_scaling=None))
        # Gemma scales the embeddings by sqrt(hidden) in the weights' dtype (not folded: the output matrix is tied).
        scale = description.embedding_scale
        self.embed_scale = None if scale is None else torch.tensor(scale, dtype=embed.dtype)
        # The sliding layers' window: forward_chunks plans one window's masks per step.
        windows = description.windows
        assert len(windows) <= 1, f"one sliding window per model, got {windows}"
        self.window = windows[0] if windows else None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def own_decode_arithmetic(self) -> bool:
        """Whether decoded tokens' K/V come from the native step's arithmetic rather than PyTorch's (a part of the
        cache identity: engine/runtime/identity.py)."""
        return self.graphs is not None and self.graphs.owns_one_token_rows

    def warm_up_batches(self) -> list[int]:
        """The batch sizes whose decode step the engine runs once before serving (captured CUDA graphs)."""
        return [] if self.graphs is None else list(self.graphs.batches)

    def rope_tables(self) -> list[RotaryTable]:
        """Every RoPE table the forward reads (the engine builds them for the whole context at start)."""
        return [t for t in (self.rotary, self.rotary_local) if t is not None]

    @property
    def expert_bytes(self) -> int:
        """Resident bytes of the routed experts' weights, the expert arena (0 for a dense model)."""
        layers = cast(Iterable[DecoderLayer], self.layers)
        blocks = [layer.moe if layer.moe is not None else layer.experts.moe if layer.experts is not None else None
                  for layer in layers]  # Gemma 4's block beside the MLP too
        return sum(b.expert_bytes for b in blocks if b is not None)

    @torch.inference_mode()
    def forward_chunks(
        self, chunks: list[SeqChunk], kv: KVBuffers, all_logits: bool = False
    ) -> torch.Tensor | list[torch.Tensor]:
        """Run `chunks`, writing their K/V (after RoPE) into `kv` at rows [start, start+len) of each slot.

        Returns float32 logits on the last stage's device: [len(chunks), vocab] for the last position of
        each chunk, or with `all_logits` a list of [len_i, vocab] tensors in chunk order.
        """
        assert chunks, "forward_chunks needs at least one chunk"
        if self.graphs is not None and not all_logits:
            captured = self.graphs.run(chunks, kv)
            if captured is not None:
                return captured
        if self.graphs is not None and self.graphs.owns_one_token_rows and any(ch.tokens.numel() == 1 for ch in chunks):
            return self._hand_over_one_token_rows(chunks, kv, all_logits)
        c = self.config
        assert kv.layout.n_layers == c.kv_layers and (kv.layout.n_kv_heads, kv.layout.head_dim) == c.kv_row, (
            "K/V layout mismatch")
        assert kv.layout.dtype.is_floating_point, "K/V layout mismatch"
        check_rows(chunks)
        for ch in chunks:
            n = ch.tokens.numel()
            assert ch.tokens.dim() == 1 and n > 0, "a chunk needs a 1-D, non-empty token tensor"
            assert ch.start >= 0 and ch.start + n <= kv.ctx, f"slot {ch.slot}: rows {ch.start}+{n} exceed ctx {kv.ctx}"
            assert 0 <= ch.slot < kv.n_slots, f"slot {ch.slot} out of range"

        # One-token chunks first: their rows take the gemv path (module docstring).
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].tokens.numel() != 1)
        ordered = [chunks[i] for i in order]
        lengths = [ch.tokens.numel() for ch in ordered]
        n_single = sum(1 for n in lengths if n == 1)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        total = offsets[-1]
        max_pos = max(ch.start + n for ch, n in zip(ordered, lengths, strict=True))

        first_device = self.stages[0][0]
        ids = torch.cat([ch.tokens for ch in ordered]).to(first_device)
        if n_single == total:
            positions = torch.tensor([ch.start for ch in ordered], dtype=torch.int64)
        else:
            positions = torch.cat([torch.arange(ch.start, ch.start + n) for ch, n in zip(ordered, lengths, strict=True)])
        x = embed_rows(ids, self.embed, self.embed_scale)
        ple = None if self.per_layer is None else self.per_layer(ids, x, n_single, not self.batch_invariant)

        plans = attention_plans(ordered, lengths, offsets, self.window)
        layers = cast(list[DecoderLayer], list(self.layers))
        for device, first, end in self.stages:
            x = x.to(device)
            pos = positions.to(device)
            rope = rope_rows(self.rotary, max_pos, pos, device, self.dtype)
            local_rope = rope if self.rotary_local is None else rope_rows(self.rotary_local, max_pos, pos, device, self.dtype)
            masks = {i: m.to(device) for i, m in plans.masks.items()}
            window_masks = {i: m.to(device) for i, m in plans.window_masks.items()}
            stage_ple = None if ple is None else ple.to(device)
            for li in range(first, end):
                attention = layers[li].spec.attention
                cos, sin = local_rope if attention.rope.local else rope
                x = self._layer(layers[li], li, x, kv, ordered, plans,
                                masks if attention.window is None else window_masks, cos, sin, n_single, total,
                                None if stage_ple is None else stage_ple[:, li])

        if self.hidden_rows is not None:  # the rows the logits are taken from (the norm is per row)
            self.hidden_rows(ordered, offsets, rms_norm(x, self.norm, self.description.final_norm_eps))
        fast = not self.batch_invariant
        if all_logits:
            h = rms_norm(x, self.norm, self.description.final_norm_eps)
            # One-token chunks get the same per-row logits as without all_logits.
            parts = [logit_rows(h[:n_single], self.lm_head, fast=fast)] if n_single else []
            if total > n_single:
                parts.append(linear(h[n_single:], self.lm_head, 0, fast=fast))
            logits = self._soft_cap(torch.cat(parts).float() if len(parts) > 1 else parts[0].float())
            out = [logits[offsets[k] : offsets[k + 1]] for k in range(len(ordered))]
            result: list[torch.Tensor] = [None] * len(chunks)  # type: ignore[list-item]
            for k, i in enumerate(order):
                result[i] = out[k]
            return result
        if total != len(ordered):
            x = x.index_select(0, torch.tensor([offsets[k + 1] - 1 for k in range(len(ordered))], device=x.device))
        logits = self._soft_cap(logit_rows(rms_norm(x, self.norm, self.description.final_norm_eps), self.lm_head, fast=fast).float())
        if order == sorted(order):
            return logits
        inverse = torch.empty(len(order), dtype=torch.int64)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return logits.index_select(0, inverse.to(logits.device))

    def _hand_over_one_token_rows(
        self, chunks: list[SeqChunk], kv: KVBuffers, all_logits: bool
    ) -> torch.Tensor | list[torch.Tensor]:
        """forward_chunks' result with the one-token chunks run by the runner that owns them and the others here."""
        assert self.graphs is not None
        single = [i for i, ch in enumerate(chunks) if ch.tokens.numel() == 1]
        longer = [i for i, ch in enumerate(chunks) if ch.tokens.numel() != 1]
        owned = self.graphs.run([chunks[i] for i in single], kv)
        assert owned is not None, "a runner that owns one-token rows runs every step of them"
        rows: list[torch.Tensor] = [torch.empty(0)] * len(chunks)
        for k, i in enumerate(single):
            rows[i] = owned[k : k + 1]
        if longer:
            rest = self.forward_chunks([chunks[i] for i in longer], kv, all_logits)
            for k, i in enumerate(longer):
                rows[i] = rest[k] if isinstance(rest, list) else rest[k : k + 1]
        return rows if all_logits else torch.cat(rows)

    def _soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.description.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _layer(
        self,
        layer: DecoderLayer,
        li: int,
        x: torch.Tensor,
        kv: KVBuffers,
        chunks: list[SeqChunk],
        plans: AttentionPlans,
        masks: dict[int, torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        n_single: int,
        total: int,
        per_layer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if layer.mla is not None:  # the latent rows, not per-head K/V (engine/model/mla.py)
            latent = layer.mla.attend(layer, x, kv.layer(li), chunks, plans.offsets, masks, plans.causal, cos, sin,
                                      n_single, not self.batch_invariant)
            return self.attention_out_and_mlp(layer, x, latent, n_single)
        c = self.config
        kv_heads, D = c.layer_heads(li)
        H = c.n_heads
        q, k, v = self.qkv(layer, x, cos, sin, n_single, total)
        shared = layer.spec.kv_source is not None  # Gemma 4: attends to an earlier layer's K/V, writes none
        k_cache, v_cache = kv.layer(li if layer.spec.kv_source is None else layer.spec.kv_source)
        if k_cache.shape[-2:] != (kv_heads, D):  # a narrower layer than the slots' row: its first channels
            k_cache, v_cache = (t.flatten(-2)[..., : kv_heads * D].unflatten(-1, (kv_heads, D)) for t in (k_cache, v_cache))
        small_float32 = x.dtype == torch.float32 and x.device.type == "cpu"
        one = len(chunks) == 1
        attn = None if one else torch.empty(total, H, D, dtype=x.dtype, device=x.device)
        window, scale = layer.spec.attention.window, layer.spec.attention.scale
        causal = plans.causal if window is None else plans.window_causal
        for i, ch in enumerate(chunks):
            lo, hi = plans.offsets[i], plans.offsets[i + 1]
            end = ch.start + (hi - lo)
            if not shared:
                k_cache[ch.slot, ch.start : end] = k[lo:hi]
                v_cache[ch.slot, ch.start : end] = v[lo:hi]
            # A sliding layer reads only its window's rows (sliding.py); `masks` are then the window masks.
            seen = first_key(ch.start, window)
            keys, values = k_cache[ch.slot, seen:end].transpose(0, 1), v_cache[ch.slot, seen:end].transpose(0, 1)
            if keys.dtype != q.dtype or keys.device != q.device:  # a narrower --kv-dtype; a shared layer's source
                keys, values = keys.to(q.device, q.dtype), values.to(q.device, q.dtype)  # on another stage
            if layer.sinks is not None:  # gpt-oss
                out = sink_attention(q[lo:hi], keys, values, masks.get(i), causal[i], scale, layer.sinks)
            elif hi - lo == 1 and small_float32:
                out = decode_attention(q[lo], keys, values, scale)
            else:
                query = q[lo:hi].transpose(0, 1).unsqueeze(0)
                out = sdpa(query, keys.unsqueeze(0), values.unsqueeze(0), masks.get(i), causal[i], scale)
                out = out[0].transpose(0, 1)
            if one:
                attn = out
            else:
                assert attn is not None  # allocated above for several chunks
                attn[lo:hi] = out
        assert attn is not None
        return self.attention_out_and_mlp(layer, x, attn.reshape(total, H * D), n_single, per_layer)

    def qkv(
        self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_single: int, total: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's q [total, H, D], k and v [total, KVH, D] for x [total, hidden], RoPE applied (cos and sin
        per row, sin in the rolled-sign form of forward_chunks)."""
        c = self.config
        KVH, D = c.layer_heads(layer.spec.index)
        if layer.spec.kv_source is not None:  # Gemma 4's K/V-sharing layer: q alone
            KVH = 0
        H = c.n_heads
        eps = layer.spec.norm.eps
        h = rms_norm(x, layer.attn_norm, eps)
        qkv = linear(h, layer.wqkv, n_single, layer.bqkv, fast=not self.batch_invariant)
        if layer.q_norm_full is not None:  # OLMoE (DecoderLayer)
            assert layer.k_norm_full is not None  # set with q_norm_full (DecoderLayer)
            qw, kw = H * D, KVH * D
            qkv = torch.cat((rms_norm(qkv[:, :qw], layer.q_norm_full, eps),
                             rms_norm(qkv[:, qw : qw + kw], layer.k_norm_full, eps), qkv[:, qw + kw :]), 1)
        qk = qkv[:, : (H + KVH) * D].view(total, H + KVH, D)
        v = qkv[:, (H + KVH) * D :].view(total, KVH, D)
        if layer.qk_norm is not None:
            qk = head_rms_norm(qk.to(x.dtype), layer.qk_norm, eps)
        if layer.spec.attention.value_norm:  # Gemma 4: each value head normalised, no weight
            v = head_rms_norm(v.to(x.dtype), None, eps)
        # Rotate-half RoPE as one roll: roll(qk) * sin_rolled == cat(-qk2, qk1) * sin, bit for bit (the sign
        # of the first half lives in sin_rolled, see forward_chunks). Promotes a bfloat16 qkv to x's dtype.
        rotated = cos.shape[-1]
        if rotated == D:
            qk = qk * cos + qk.roll(D // 2, -1) * sin
        else:  # partial RoPE: the leading `rotated` channels turn (rotate-half within them), the rest pass
            head = qk[..., :rotated]
            head = head * cos + head.roll(rotated // 2, -1) * sin
            qk = torch.cat((head, qk[..., rotated:].to(head.dtype)), -1)
        return qk[:, :H], qk[:, H:], v

    def attention_out_and_mlp(self, layer: DecoderLayer, x: torch.Tensor, attn: torch.Tensor, n_single: int,
                              per_layer: torch.Tensor | None = None) -> torch.Tensor:
        """The rest of a layer after attention: x + o(attn), then the MLP (or the experts) with its residual, then
        Gemma 4's per-layer input and scalar (`per_layer`: this layer's [tokens, width] inputs)."""
        spec = layer.spec
        eps = spec.norm.eps
        fast = not self.batch_invariant
        attn_out = linear(attn, layer.wo, n_single, layer.bo, fast=fast)
        if layer.post_attn_norm is not None:  # Gemma 3
            attn_out = rms_norm(attn_out.to(x.dtype), layer.post_attn_norm, eps)
        x = x + attn_out
        h = rms_norm(x, layer.mlp_norm, eps)
        if layer.moe is not None:
            return per_layer_residual(layer, x + layer.moe(h, n_single, fast=fast), per_layer, n_single, fast)
        assert layer.w_gate_up is not None and layer.w_down is not None  # a dense layer (DecoderLayer)
        gate_up = linear(h, layer.w_gate_up, n_single, fast=fast)
        inter = spec.mlp.size
        if spec.mlp.activation == "gelu_tanh":  # GeGLU with the tanh approximation of GeLU
            act = F.gelu(gate_up[:, :inter].to(x.dtype), approximate="tanh") * gate_up[:, inter:]
        else:
            act = F.silu(gate_up[:, :inter].to(x.dtype)) * gate_up[:, inter:]
        mlp_out = linear(act, layer.w_down, n_single, fast=fast)
        if layer.experts is not None:  # Gemma 4: the experts beside the MLP, on the residual, summed with it
            mlp_out = layer.experts(x, mlp_out, n_single, fast)
        if layer.post_mlp_norm is not None:
            mlp_out = rms_norm(mlp_out.to(x.dtype), layer.post_mlp_norm, eps)
        return per_layer_residual(layer, x + mlp_out, per_layer, n_single, fast)
