"""The hybrid forward pass: recurrent layers (short conv, gated DeltaNet, Mamba-2) + attention layers.

`HybridCausalLM.forward_chunks(chunks, kv, state)` has the contract of `CausalLM.forward_chunks` plus the
recurrent state: one call runs any mix of chunks from different slots; attention layers write K/V rows of
their slot into `kv` (a KVBuffers whose layers are the attention layers only, `kv_layout`/`kv_stages`);
recurrent layers read the slot's state from `state` (RecurrentStateBuffers), advance it over the chunk and
write it back. So a prompt prefilled in chunks gives the logits of a one-shot prefill within float rounding
(the scans cut their blocks at absolute positions, so chunk edges on block boundaries change nothing in the
recurrent layers), and one-token chunks of many slots (decode) run each recurrent update as one batched step.
A slot may also bring several one-token rows at consecutive positions (a speculative verify): each recurrent
layer runs them in order (`Batch.step_singles`), so each row computes what decoding its token alone computes.
A slot's results do not depend on what it is batched with (bit for bit on CPU float32; see `batch.lanewise`).

A chunk must start where its slot's state is (`state.positions[slot]`), or at 0 (a fresh sequence: the
state starts at zero whatever the buffers hold). Checkpoints: `state.request_checkpoints(slot, positions)`
before the call makes the recurrent mixers cut their scan there and copy the state (no second pass);
`state.take_checkpoints(slot)` returns them as StateSnapshots that `state.write` restores.

Projections go through `engine.model.projections.linear` (batch-invariant on CPU float32: a slot's logits do not
depend on what it was batched with) and logits through `logit_rows`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.kv import KVBuffers, KVLayout
from engine.model.hybrid.batch import Batch
from engine.model.hybrid.config import HybridConfig
from engine.model.hybrid.recurrent_state import RecurrentStateBuffers, StateLayout
from engine.model.int4 import Int4Weight
from engine.model.llama import SeqChunk, check_rows, rms_norm
from engine.model.moe import SparseMoe
from engine.model.projections import linear, logit_rows
from engine.model.q8_output import Q8Output
from engine.model.quant_embedding import QuantEmbedding, embed_rows
from engine.model.rope import RotaryTable

if TYPE_CHECKING:
    from engine.model.mtp import MtpLayer


class HybridLayer(torch.nn.Module):
    """norm -> mixer (attention or recurrent) -> residual; norm -> gated MLP (or experts) -> residual."""

    # The buffers registered in __init__, typed (nn.Module's attribute lookup is typed Tensor | Module);
    # int4.quantize_model replaces the projection weights by Int4Weight ones.
    mixer_norm: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor | Int4Weight | None
    w_down: torch.Tensor | Int4Weight | None

    def __init__(
        self, kind: str, mixer: torch.nn.Module, *, mixer_norm: torch.Tensor, mlp_norm: torch.Tensor,
        w_gate_up: torch.Tensor | None = None, w_down: torch.Tensor | None = None, moe: SparseMoe | None = None,
    ) -> None:
        super().__init__()
        # a layer has a dense MLP or an expert block (Qwen3-Next, Qwen3.5-MoE), never both
        assert (moe is None) == (w_gate_up is not None) == (w_down is not None), "dense MLP xor experts"
        assert w_gate_up is None or w_down is None or w_gate_up.shape[0] == 2 * w_down.shape[1], (
            tuple(w_gate_up.shape), tuple(w_down.shape))
        self.kind = kind
        self.mixer = mixer
        self.moe = moe
        self.register_buffer("mixer_norm", mixer_norm, persistent=False)
        self.register_buffer("mlp_norm", mlp_norm, persistent=False)
        self.register_buffer("w_gate_up", w_gate_up, persistent=False)
        self.register_buffer("w_down", w_down, persistent=False)


class HybridCausalLM(torch.nn.Module):
    """A hybrid decoder-only model whose layers may be spread over several devices (stages)."""

    # The buffers registered in __init__, typed (nn.Module's attribute lookup is typed Tensor | Module);
    # int4.quantize_model replaces the projection weights by Int4Weight ones.
    embed: torch.Tensor | QuantEmbedding  # a GGUF's own blocks on the CPU (hybrid/loader.py, quant_embedding.py)
    norm: torch.Tensor
    lm_head: torch.Tensor | Int4Weight | Q8Output  # the file's Q8_0 blocks: engine/model/q8_output.py

    def __init__(
        self, config: HybridConfig, stages: list[tuple[torch.device, int, int]], *, embed: torch.Tensor,
        layers: list[torch.nn.Module], norm: torch.Tensor, lm_head: torch.Tensor,
    ) -> None:
        super().__init__()
        assert len(layers) == config.n_layers, (len(layers), config.n_layers)
        assert stages and stages[0][1] == 0 and stages[-1][2] == config.n_layers, stages
        assert [layer.kind for layer in layers] == list(config.layer_kinds)
        self.config = config
        self.stages = [(torch.device(d), a, b) for d, a, b in stages]
        self.register_buffer("embed", embed, persistent=False)
        self.layers = torch.nn.ModuleList(layers)
        self.register_buffer("norm", norm, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.rotary = RotaryTable(config.rope_shape()) if config.rotary_dim else None  # type: ignore[arg-type]
        # The file's next-token layers, kept as it holds them (engine/model/mtp.py; Qwen3-Next, Qwen3.5), and
        # `--spec mtp`'s hook for the rows the logits are taken from, as CausalLM's (engine/runtime/mtp_drafts.py).
        self.mtp: tuple[MtpLayer, ...] = ()
        self.hidden_rows: Callable[[list[SeqChunk], list[int], torch.Tensor], None] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def embed_scale(self) -> torch.Tensor | None:
        """What a next-token layer scales its embeddings by, as CausalLM's: nothing (the families with such
        layers have no embedding multiplier)."""
        assert self.config.embedding_multiplier == 1.0, "a next-token layer of a scaled embedding"
        return None

    # ------------------------------------------------------------ buffers this model runs on

    def kv_layout(self, kv_dtype: torch.dtype | None = None) -> KVLayout:
        """K/V of the attention layers only (K/V layer i = the i-th attention layer), in `kv_dtype`
        (`--kv-dtype`; None = the compute dtype). Attention reads narrower K/V rows in the compute dtype."""
        c = self.config
        return KVLayout(len(c.attention_layers), c.n_kv_heads, c.head_dim, kv_dtype or self.dtype)

    def kv_stages(self) -> list[tuple[torch.device, int, int]]:
        """The model's stages in K/V layer numbering (a stage may hold no attention layer)."""
        attn = self.config.attention_layers
        return [(d, sum(1 for li in attn if li < a), sum(1 for li in attn if li < b)) for d, a, b in self.stages]

    def state_layout(self) -> StateLayout:
        """Recurrent state is kept in float32 whatever the weights' dtype: it accumulates over the whole
        sequence, and it is small (a few MiB per slot even for large models)."""
        return StateLayout.for_config(self.config, torch.float32)

    def new_buffers(
        self, n_slots: int, ctx: int, kv_dtype: torch.dtype | None = None
    ) -> tuple[KVBuffers, RecurrentStateBuffers]:
        return (
            KVBuffers(self.kv_layout(kv_dtype), n_slots, ctx, self.kv_stages()),
            RecurrentStateBuffers(self.state_layout(), n_slots, self.stages),
        )

    # ------------------------------------------------------------ forward

    # What the engine asks of every model (engine/runtime/protocols.py): no captured or native decode step here.
    own_decode_arithmetic = False

    def warm_up_batches(self) -> list[int]:
        return []

    def rope_tables(self) -> list[RotaryTable]:
        return [] if self.rotary is None else [self.rotary]

    @torch.inference_mode()
    def forward_chunks(
        self, chunks: list[SeqChunk], kv: KVBuffers, state: RecurrentStateBuffers, all_logits: bool = False
    ) -> torch.Tensor | list[torch.Tensor]:
        """Run `chunks`; returns float32 logits like `CausalLM.forward_chunks` (see the module docstring)."""
        assert chunks, "forward_chunks needs at least one chunk"
        c = self.config
        assert kv.layout == self.kv_layout(kv.layout.dtype), (
            f"K/V layout {kv.layout} does not match the model's {self.kv_layout()}")
        assert state.layout == self.state_layout(), "recurrent state layout does not match the model"
        check_rows(chunks)  # one chunk per slot, or its one-token rows at consecutive positions (a verify)
        leading: dict[int, SeqChunk] = {}  # each slot's first chunk: where its recurrent state must be
        for ch in chunks:
            leading.setdefault(ch.slot, ch)
        for ch in chunks:
            n = ch.tokens.numel()
            assert ch.tokens.dim() == 1 and n > 0, "a chunk needs a 1-D, non-empty token tensor"
            assert 0 <= ch.slot < kv.n_slots and ch.slot < state.n_slots, f"slot {ch.slot} out of range"
            assert ch.start >= 0 and ch.start + n <= kv.ctx, f"slot {ch.slot}: rows {ch.start}+{n} exceed ctx {kv.ctx}"
            assert ch is not leading[ch.slot] or ch.start in (0, state.positions[ch.slot]), (
                f"slot {ch.slot}: chunk starts at {ch.start} but its recurrent state is at "
                f"{state.positions[ch.slot]} (restore the state with the K/V, or start at 0)"
            )

        order = sorted(range(len(chunks)), key=lambda i: chunks[i].tokens.numel() != 1)
        ordered = [chunks[i] for i in order]
        lengths = [ch.tokens.numel() for ch in ordered]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        n_single = sum(1 for n in lengths if n == 1)
        batch = Batch(ordered, offsets, n_single, kv, state)
        total = offsets[-1]
        positions = torch.cat([torch.arange(ch.start, ch.start + n) for ch, n in zip(ordered, lengths, strict=True)])
        max_pos = max(ch.start + n for ch, n in zip(ordered, lengths, strict=True))

        x = embed_rows(torch.cat([ch.tokens for ch in ordered]).to(self.stages[0][0]), self.embed)
        if c.embedding_multiplier != 1.0:
            x = x * c.embedding_multiplier
        for device, first, end in self.stages:
            x = x.to(device)
            if self.rotary is not None:
                cos, sin = self.rotary.get(max_pos, device, self.dtype)
                pos = positions.to(device)
                batch.cos, batch.sin = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
            for li in range(first, end):
                x = self._layer(self.layers[li], x, batch)
        ends = {ch.slot: ch.start + n for ch, n in zip(ordered, lengths, strict=True)}  # a slot's last row's end
        for slot, end in ends.items():
            state.finish_chunk(slot, end)

        h = rms_norm(x, self.norm, c.rms_norm_eps)
        if self.hidden_rows is not None:  # the rows the logits are taken from, every row (the norm is per row)
            self.hidden_rows(ordered, offsets, h)
        if not all_logits and total != len(ordered):
            h = h.index_select(0, torch.tensor([offsets[k + 1] - 1 for k in range(len(ordered))], device=h.device))
        if all_logits:
            parts = [logit_rows(h[:n_single], self.lm_head)] if n_single else []
            if total > n_single:
                parts.append(linear(h[n_single:], self.lm_head, 0))
            logits = (torch.cat(parts) if len(parts) > 1 else parts[0]).float()
        else:
            logits = logit_rows(h, self.lm_head).float()
        if c.logits_scaling != 1.0:
            logits = logits / c.logits_scaling
        if all_logits:
            out = [logits[offsets[k] : offsets[k + 1]] for k in range(len(ordered))]
            result: list[torch.Tensor] = [None] * len(chunks)  # type: ignore[list-item]
            for k, i in enumerate(order):
                result[i] = out[k]
            return result
        if order == sorted(order):
            return logits
        inverse = torch.empty(len(order), dtype=torch.int64)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return logits.index_select(0, inverse.to(logits.device))

    def _layer(self, layer: torch.nn.Module, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if not isinstance(layer, HybridLayer):  # a layer of its own structure (engine/model/hybrid/blocks.py)
            return layer(x, batch)
        c = self.config
        h = rms_norm(x, layer.mixer_norm, c.rms_norm_eps)
        y = layer.mixer(h, batch)
        x = x + y * c.residual_multiplier if c.residual_multiplier != 1.0 else x + y
        h = rms_norm(x, layer.mlp_norm, c.rms_norm_eps)
        if layer.moe is not None:
            y = layer.moe(h, batch.n_single)
        else:
            assert layer.w_gate_up is not None and layer.w_down is not None  # a dense layer (see HybridLayer)
            gate_up = linear(h, layer.w_gate_up, batch.n_single)
            inter = layer.w_down.shape[1]
            y = linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], layer.w_down, batch.n_single)
        return x + y * c.residual_multiplier if c.residual_multiplier != 1.0 else x + y


