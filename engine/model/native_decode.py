"""The native CPU decode step: a step of one-token rows of a dense model with native 4-bit weights as one call
into engine/model/kernels/step.c.

Through PyTorch (engine/model/cpu_decode.py) a decode step of the bundled model on one thread of an AVX2 CPU took
~18 ms, of which the weight products were ~12.5 and the rest ~1,500 operator calls and their Python; step.c runs
the same layer (norms, q/k/v, RoPE, the K/V writes, attention, SiLU, the residuals) between the same products in
one loop (docs/BENCHMARKS.md has the figures).

Its arithmetic is its own (its norms, exponentials and attention sums are not ATen's, ~1e-6 apart), so it owns
every one-token row of the model: forward_chunks hands it the one-token rows of a mixed step too
(`owns_one_token_rows`), and a row's logits and K/V are the same whether it decodes alone, batched or beside a
prefill (step.c's invariants). Prefill chunks stay on forward_chunks. The engine takes this runner where
`unsupported` finds nothing against it: one CPU, float32, a Llama-family model (Gemma 3's scaled embeddings,
output norms, GeGLU and local RoPE included; no soft-capped logits) or a mixture-of-experts one whose layers are
those with experts (Qwen3-MoE, Qwen2-MoE's shared expert, Mixtral, GraniteMoE, gpt-oss's sinks and biased,
clamped experts; experts.c: the router, top-k and each picked expert once over its rows), every projection and expert in the native 4-bit blocks or 8-bit rows
(engine/model/q8_weight.py) and the output matrix likewise.
"""

from __future__ import annotations

import ctypes
from typing import cast

import torch

from engine.kv import KVBuffers
from engine.model import executors, kernels, native_layout
from engine.model.decoder_layer import DecoderLayer
from engine.model.int4 import Int4Weight
from engine.model.llama import CausalLM, SeqChunk, check_rows
from engine.model.moe import SparseMoe

# The structs and their layout check live in native_layout.py (layout_mismatch kept here where callers look).
from engine.model.native_layout import KV_DTYPES, ROUTINGS, StepExperts, StepLayer, StepModel, kind
from engine.model.native_layout import layout_mismatch as layout_mismatch
from engine.model.quant_embedding import embed_rows

_ERRORS = {-1: "no memory for the step's work buffers", -2: "shapes outside what step.c handles"}
_MIRRORS = native_layout.MIRRORS  # the same table: replacing a mirror in it is seen by layout_mismatch
# Why this model's decode steps do not run in step.c (None: they do); with the other executors' gates in
# executors.py.
unsupported = executors.native_step_declines


class NativeDecode:
    """Runs steps of one-token rows in step.c (module docstring); bound to one KVBuffers at a time."""

    owns_one_token_rows = True  # forward_chunks hands over the one-token rows of mixed steps too
    hands_over_hidden_rows = True  # to CausalLM.hidden_rows, as forward_chunks does (--spec mtp reads them)
    batches: tuple[int, ...] = ()  # it captures nothing

    def __init__(self, model: CausalLM) -> None:
        reason = executors.native_step_declines(model)
        assert reason is None, f"native decode step: {reason}"
        self.model = model
        self._lib = cast(kernels.Library, kernels.library())
        self._kv: KVBuffers | None = None
        self._step: StepModel | None = None
        self.steps = 0

    def _bind(self, kv: KVBuffers) -> None:
        m, c = self.model, self.model.config
        assert kv.layout.dtype in KV_DTYPES, f"K/V dtype {kv.layout.dtype} (step.c takes {list(KV_DTYPES)})"
        layers = cast(list[DecoderLayer], list(m.layers))
        rows = (StepLayer * len(layers))()
        views: list[torch.Tensor] = []  # held while step.c has their addresses
        keep: list[object] = []  # the experts' ctypes arrays, likewise
        for li, layer in enumerate(layers):
            attention = layer.spec.attention  # the struct's window and RoPE table from the layer description
            k_cache, v_cache = kv.layer(li)
            assert k_cache.is_contiguous() and v_cache.is_contiguous(), "step.c indexes K/V as [slot, ctx, KVH, D]"
            views += [k_cache, v_cache]
            vectors = (layer.attn_norm, layer.mlp_norm, layer.bqkv, layer.qk_norm, layer.post_attn_norm,
                       layer.post_mlp_norm, layer.sinks, layer.bo)
            for t in vectors:
                assert t is None or (t.dtype == torch.float32 and t.is_contiguous()), "float32 norms and biases"
            attn_norm, mlp_norm, bqkv, qk_norm, post_attn_norm, post_mlp_norm, sinks, bo = (
                None if t is None else t.data_ptr() for t in vectors)
            products = (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
            rows[li] = StepLayer(
                attn_norm, mlp_norm, _blocks(layer.wqkv), bqkv, _blocks(layer.wo), _blocks(layer.w_gate_up),
                _blocks(layer.w_down), qk_norm, post_attn_norm, post_mlp_norm, k_cache.data_ptr(),
                v_cache.data_ptr(), attention.window or 0, int(attention.rope.local),
                (ctypes.c_int64 * 4)(*(kind(w) if w is not None else 0 for w in products)),
                None if layer.moe is None else ctypes.pointer(self._experts(layer.moe, keep)), sinks, bo)
        head = m.lm_head
        activation, eps, scale = native_layout.model_wide(m.description, c.head_dim)
        self._layers, self._views, self._keep = rows, views, keep  # StepModel points into them
        self._step = StepModel(
            c.n_layers, c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads, c.head_dim, kv.ctx,
            c.vocab_size, KV_DTYPES[kv.layout.dtype], kind(head), activation, eps, scale, rows, m.norm.data_ptr(),
            _blocks(head), c.rotary_dim or c.head_dim)
        self._kv = kv

    @staticmethod
    def _experts(moe: SparseMoe, keep: list[object]) -> StepExperts:
        """A StepExperts over `moe`'s weights; its ctypes arrays go to `keep`."""
        c = moe.config
        gated = c.shared_expert_size > 0 and c.shared_gated
        assert moe.router.is_contiguous() and moe.router.shape[0] == c.n_experts + gated
        gate_up = (ctypes.c_void_p * c.n_experts)(*(_blocks(w) for w in moe.gate_up))
        down = (ctypes.c_void_p * c.n_experts)(*(_blocks(w) for w in moe.down))
        shared = c.shared_expert_size > 0
        biases = (moe.router_bias, moe.gate_up_bias, moe.down_bias)  # gpt-oss's, else None
        for t in (*biases, moe.expert_bias):
            assert t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"), "biases"
        block = StepExperts(
            c.n_experts, c.top_k, c.expert_size, c.shared_expert_size, ROUTINGS[c.routing, c.norm_topk_prob],
            moe.router.data_ptr(), gate_up, down, _blocks(moe.shared_gate_up) if shared else None,
            _blocks(moe.shared_down) if shared else None,
            (ctypes.c_int64 * 4)(kind(moe.gate_up[0]), kind(moe.down[0]),
                                 *(kind(w) if shared else 0 for w in (moe.shared_gate_up, moe.shared_down))),
            *(None if t is None else t.data_ptr() for t in biases), c.swiglu_limit or 0.0, c.swiglu_alpha or 0.0,
            None if moe.expert_bias is None else moe.expert_bias.data_ptr(), c.norm_eps, c.routed_scaling,
            int(c.norm_topk_prob), c.n_group, c.topk_group, int(gated))
        keep += [gate_up, down, block]
        return block

    def run(self, chunks: list[SeqChunk], kv: KVBuffers) -> torch.Tensor | None:
        """Logits [len(chunks), vocab] (float32, chunk order) of a step of one-token rows, or None to decline."""
        if any(ch.tokens.numel() != 1 for ch in chunks):
            return None
        if kv is not self._kv:
            self._bind(kv)
        check_rows(chunks)
        for ch in chunks:
            assert 0 <= ch.start < kv.ctx and 0 <= ch.slot < kv.n_slots, (ch.slot, ch.start, kv.ctx)
        m = self.model
        x = embed_rows(torch.cat([ch.tokens for ch in chunks]), m.embed, m.embed_scale).float().contiguous()
        assert x.shape == (len(chunks), m.config.hidden_size), tuple(x.shape)
        positions = max(ch.start for ch in chunks) + 1
        tables = [t for rotary in (m.rotary, m.rotary_local or m.rotary) for t in rotary.get(positions, x.device, torch.float32)]
        assert all(t.is_contiguous() and t.shape[1] == (m.config.rotary_dim or m.config.head_dim) for t in tables)
        rope = (ctypes.c_void_p * 4)(*(t.data_ptr() for t in tables))
        where = torch.tensor([[ch.slot for ch in chunks], [ch.start for ch in chunks]], dtype=torch.int64)
        logits = torch.empty(len(chunks), m.config.vocab_size)
        # The rows the logits are taken from, for whoever reads them (--spec mtp's drafts), as forward_chunks hands
        # them over.
        hidden = None if m.hidden_rows is None else torch.empty(len(chunks), m.config.hidden_size)
        assert self._step is not None  # _bind set it
        status = self._lib.decode_step(
            ctypes.byref(self._step), len(chunks), where[0].data_ptr(), where[1].data_ptr(), rope, x.data_ptr(),
            logits.data_ptr(), None if hidden is None else hidden.data_ptr(), torch.get_num_threads())
        if status == -1:
            raise MemoryError(f"native decode step: {_ERRORS[status]}")
        assert status == 0, f"native decode step: {_ERRORS.get(status, status)}"
        if m.hidden_rows is not None and hidden is not None:
            m.hidden_rows(chunks, list(range(len(chunks) + 1)), hidden)
        self.steps += 1
        return logits


def _blocks(w: object) -> int | None:
    """The address of a native weight's blocks (None for no weight: a MoE layer's dense MLP)."""
    if w is None:
        return None
    blocks = cast(Int4Weight | kernels.RowsWeight, w).blocks
    assert blocks.is_contiguous() and blocks.dtype == torch.uint8, (blocks.dtype, tuple(blocks.shape))
    return blocks.data_ptr()
