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
those with experts (Qwen3-MoE, Qwen2-MoE's shared expert, Mixtral, GraniteMoE; experts.c: the router, top-k and
each picked expert once over its rows), every projection and expert in the native 4-bit blocks or 8-bit rows
(engine/model/q8_weight.py) and the output matrix likewise.
"""

from __future__ import annotations

import ctypes
from typing import cast

import torch

from engine.kv import KVBuffers
from engine.model import kernels
from engine.model.int4 import Int4Weight
from engine.model.llama import CausalLM, DecoderLayer, SeqChunk, check_rows
from engine.model.moe import SparseMoe
from engine.model.quant_embedding import embed_rows

_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # step.c's KV_* codes
_SILU, _GELU_TANH = 0, 1
_ROUTINGS = {("softmax_topk", False): 0, ("softmax_topk", True): 1, ("topk_softmax", False): 2,
             ("topk_softmax", True): 2}  # experts.h's routings by (MoeConfig.routing, norm_topk_prob)
_ERRORS = {-1: "no memory for the step's work buffers", -2: "shapes outside what step.c handles"}


class StepExperts(ctypes.Structure):
    """experts.h's StepExperts, field for field."""

    _fields_ = [*((name, ctypes.c_int64) for name in ("n_experts", "top_k", "inter", "shared_inter", "routing")),
                ("router", ctypes.c_void_p), ("gate_up", ctypes.POINTER(ctypes.c_void_p)),
                ("down", ctypes.POINTER(ctypes.c_void_p)), ("shared_gate_up", ctypes.c_void_p),
                ("shared_down", ctypes.c_void_p), ("kinds", ctypes.c_int64 * 4)]


class StepLayer(ctypes.Structure):
    """step.c's StepLayer, field for field."""

    _fields_ = [*((name, ctypes.c_void_p) for name in (
        "attn_norm", "mlp_norm", "wqkv", "bqkv", "wo", "w_gate_up", "w_down", "qk_norm", "post_attn_norm",
        "post_mlp_norm", "k_cache", "v_cache")), ("window", ctypes.c_int64), ("local", ctypes.c_int64),
        ("kinds", ctypes.c_int64 * 4), ("experts", ctypes.POINTER(StepExperts))]


class StepModel(ctypes.Structure):
    """step.c's StepModel, field for field."""

    _fields_ = [*((name, ctypes.c_int64) for name in (
        "n_layers", "hidden", "inter", "n_heads", "n_kv_heads", "head_dim", "ctx", "vocab", "kv_dtype", "head_kind",
        "activation")),
        ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("layers", ctypes.POINTER(StepLayer)),
        ("norm", ctypes.c_void_p), ("head", ctypes.c_void_p)]


_MIRRORS = {"StepModel": StepModel, "StepLayer": StepLayer, "StepExperts": StepExperts}


def layout_mismatch(lib: kernels.Library) -> str | None:
    """How step.c's structs as this library compiled them (its step_layout table) differ from the ctypes mirrors
    above, or None when every size and field offset agrees: a field added on one side only would otherwise be
    read as another field."""
    ours: dict[tuple[str, str], tuple[int, int]] = {}
    for name, mirror in _MIRRORS.items():
        ours[name, ""] = (0, ctypes.sizeof(mirror))
        for field, *_ in mirror._fields_:
            described = getattr(mirror, field)
            ours[name, field] = (described.offset, described.size)
    compiled = lib.layout()
    differ = sorted(key for key in ours.keys() | compiled.keys() if ours.get(key) != compiled.get(key))
    if not differ:
        return None
    names = ", ".join(f"{t}.{f}" if f else f"sizeof({t})" for t, f in differ)
    first = "; ".join(f"{t}.{f or 'size'} {ours.get((t, f))} here, {compiled.get((t, f))} in C" for t, f in differ[:3])
    return f"step.c's structs differ from native_decode.py's in {names} ((offset, size): {first})"


def _native(w: object) -> bool:
    return isinstance(w, kernels.RowsWeight) or (isinstance(w, Int4Weight) and w.kernel == "blocks")


def _kind(w: object) -> int:
    """blocks.h's ROWS_* for a native weight (0: Int4Weight's Q4 runs)."""
    code = w.rows_code if isinstance(w, kernels.RowsWeight) else 0
    assert code >= 0, type(w)
    return code


def unsupported(model: CausalLM) -> str | None:
    """Why this model's decode steps do not run in step.c (None: they do)."""
    c = model.config
    layers = cast(list[DecoderLayer], list(model.layers))
    if len({d for d, _, _ in model.stages}) != 1 or model.stages[0][0].type != "cpu":
        return "not on one CPU device"
    if model.dtype != torch.float32:
        return "compute dtype is not float32"
    if any(layer.q_norm_full is not None for layer in layers):
        return "full-width q/k norms"
    if c.final_logit_softcapping is not None:
        return "soft-capped logits"
    lib = kernels.library()
    if lib is None:
        return f"no native kernels ({kernels.unavailable_reason()})"
    if mismatch := layout_mismatch(lib):
        return mismatch
    if not all(_native(w) for layer in layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
               if layer.moe is None or w is not None):
        return "projections not in the native 4-bit blocks"
    experts = next((why for layer in layers if layer.moe is not None and (why := _experts_unsupported(layer.moe))), None)
    if experts:
        return experts
    if not _native(model.lm_head):
        return "output matrix not in native 4- or 8-bit blocks"
    if c.head_dim % 8 or c.head_dim > 512 or c.n_heads % c.n_kv_heads or c.n_heads // c.n_kv_heads * c.head_dim > 4096:
        return f"head shape {c.n_heads}x{c.head_dim} over {c.n_kv_heads} K/V heads"  # step.c's MAX_* limits
    return None


def _experts_unsupported(moe: SparseMoe) -> str | None:
    """Why step.c cannot run this expert block (None: it can)."""
    c = moe.config
    stacks = (moe.gate_up, moe.down)
    if any(isinstance(w, torch.Tensor) or not all(_native(x) and type(x) is type(w[0]) for x in w) for w in stacks):
        return "experts not in the native 4-bit blocks"
    shared = (moe.shared_gate_up, moe.shared_down)
    if c.shared_expert_size and not all(_native(w) for w in shared):
        return "shared expert not in native 4- or 8-bit blocks"
    if c.top_k > 64 or c.expert_size % 32 or c.shared_expert_size % 32:
        return f"experts of {c.expert_size} with top {c.top_k}"  # experts.c's limits
    if moe.router.dtype != torch.float32 or moe.router.device.type != "cpu":
        return "router not float32 on the CPU"
    return None


class NativeDecode:
    """Runs steps of one-token rows in step.c (module docstring); bound to one KVBuffers at a time."""

    owns_one_token_rows = True  # forward_chunks hands over the one-token rows of mixed steps too

    def __init__(self, model: CausalLM) -> None:
        reason = unsupported(model)
        assert reason is None, f"native decode step: {reason}"
        self.model = model
        self._lib = cast(kernels.Library, kernels.library())
        self._kv: KVBuffers | None = None
        self._step: StepModel | None = None
        self.steps = 0

    def _bind(self, kv: KVBuffers) -> None:
        m, c = self.model, self.model.config
        assert kv.layout.dtype in _KV_DTYPES, f"K/V dtype {kv.layout.dtype} (step.c takes {list(_KV_DTYPES)})"
        layers = cast(list[DecoderLayer], list(m.layers))
        rows = (StepLayer * len(layers))()
        views: list[torch.Tensor] = []  # held while step.c has their addresses
        keep: list[object] = []  # the experts' ctypes arrays, likewise
        for li, layer in enumerate(layers):
            k_cache, v_cache = kv.layer(li)
            assert k_cache.is_contiguous() and v_cache.is_contiguous(), "step.c indexes K/V as [slot, ctx, KVH, D]"
            views += [k_cache, v_cache]
            vectors = (layer.attn_norm, layer.mlp_norm, layer.bqkv, layer.qk_norm, layer.post_attn_norm,
                       layer.post_mlp_norm)
            for t in vectors:
                assert t is None or (t.dtype == torch.float32 and t.is_contiguous()), "float32 norms and biases"
            attn_norm, mlp_norm, bqkv, qk_norm, post_attn_norm, post_mlp_norm = (
                None if t is None else t.data_ptr() for t in vectors)
            local = c.layer_window(li) is not None and m.rotary_local is not None  # Gemma's sliding layers
            products = (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
            rows[li] = StepLayer(
                attn_norm, mlp_norm, _blocks(layer.wqkv), bqkv, _blocks(layer.wo), _blocks(layer.w_gate_up),
                _blocks(layer.w_down), qk_norm, post_attn_norm, post_mlp_norm, k_cache.data_ptr(),
                v_cache.data_ptr(), c.layer_window(li) or 0, int(local),
                (ctypes.c_int64 * 4)(*(_kind(w) if w is not None else 0 for w in products)),
                None if layer.moe is None else ctypes.pointer(self._experts(layer.moe, keep)))
        head = m.lm_head
        scale = c.head_dim**-0.5 if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar**-0.5
        self._layers, self._views, self._keep = rows, views, keep  # StepModel points into them
        self._step = StepModel(
            c.n_layers, c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads, c.head_dim, kv.ctx,
            c.vocab_size, _KV_DTYPES[kv.layout.dtype], _kind(head),
            _GELU_TANH if c.gemma else _SILU, c.rms_norm_eps, scale, rows, m.norm.data_ptr(), _blocks(head))
        self._kv = kv

    @staticmethod
    def _experts(moe: SparseMoe, keep: list[object]) -> StepExperts:
        """A StepExperts over `moe`'s weights; its ctypes arrays go to `keep`."""
        c = moe.config
        assert moe.router.is_contiguous() and moe.router.shape[0] == c.n_experts + (c.shared_expert_size > 0)
        gate_up = (ctypes.c_void_p * c.n_experts)(*(_blocks(w) for w in moe.gate_up))
        down = (ctypes.c_void_p * c.n_experts)(*(_blocks(w) for w in moe.down))
        shared = c.shared_expert_size > 0
        block = StepExperts(
            c.n_experts, c.top_k, c.expert_size, c.shared_expert_size, _ROUTINGS[c.routing, c.norm_topk_prob],
            moe.router.data_ptr(), gate_up, down, _blocks(moe.shared_gate_up) if shared else None,
            _blocks(moe.shared_down) if shared else None,
            (ctypes.c_int64 * 4)(_kind(moe.gate_up[0]), _kind(moe.down[0]),
                                 *(_kind(w) if shared else 0 for w in (moe.shared_gate_up, moe.shared_down))))
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
        assert all(t.is_contiguous() and t.shape[1] == m.config.head_dim for t in tables)
        rope = (ctypes.c_void_p * 4)(*(t.data_ptr() for t in tables))
        where = torch.tensor([[ch.slot for ch in chunks], [ch.start for ch in chunks]], dtype=torch.int64)
        logits = torch.empty(len(chunks), m.config.vocab_size)
        assert self._step is not None  # _bind set it
        status = self._lib.decode_step(
            ctypes.byref(self._step), len(chunks), where[0].data_ptr(), where[1].data_ptr(), rope, x.data_ptr(),
            logits.data_ptr(), torch.get_num_threads())
        if status == -1:
            raise MemoryError(f"native decode step: {_ERRORS[status]}")
        assert status == 0, f"native decode step: {_ERRORS.get(status, status)}"
        self.steps += 1
        return logits


def _blocks(w: object) -> int | None:
    """The address of a native weight's blocks (None for no weight: a MoE layer's dense MLP)."""
    if w is None:
        return None
    blocks = cast(Int4Weight | kernels.RowsWeight, w).blocks
    assert blocks.is_contiguous() and blocks.dtype == torch.uint8, (blocks.dtype, tuple(blocks.shape))
    return blocks.data_ptr()
