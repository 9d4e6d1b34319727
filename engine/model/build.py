"""Building the CausalLM from a tensor getter (the format readers' common back end), and what a load returns."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from gguf import GGMLQuantizationType

from engine import startup_progress
from engine.errors import ModelLoadError
from engine.model import int4, kquant_weight, mla, moe, moe_loading, moe_offload, q8_output, q8_weight
from engine.model.config import ModelConfig
from engine.model.decoder_layer import DecoderLayer
from engine.model.gemma4 import proportional_factors
from engine.model.gemma4_experts import ExpertShape, Gemma4Experts, routed_config
from engine.model.heap import release_freed_memory
from engine.model.int4 import Int4Weight
from engine.model.kernels import RowsWeight
from engine.model.layers import describe_layers
from engine.model.llama import CausalLM
from engine.model.per_layer_inputs import PerLayerInputs
from engine.model.q8_output import Q8Output
from engine.model.q8_weight import Q8Weight
from engine.model.quant_embedding import BlocksGetter, QuantEmbedding, kept_table
from engine.model.tokenizer import Tokenizer
from engine.model.weights_cache import DerivedWeights

log = logging.getLogger("strata.engine")


@dataclass
class LoadedModel:
    """A model ready to run, with what identifies it."""

    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    name: str
    path: str
    fingerprint: str  # xxh3-128 of the file headers and of every tensor's bytes, hashed in the one loading read
    dtype: torch.dtype
    weights_format: str = "float"  # "float", "int4" or "float16"; set by Engine.from_config from its choice of weights


def _stage_checks(config: ModelConfig, stages: list[tuple[torch.device, int, int]], path: str) -> None:
    if not stages or stages[0][1] != 0 or stages[-1][2] != config.n_layers:
        raise ModelLoadError(f"{path}: stages {stages} do not cover the model's {config.n_layers} layers")


# A getter returns a canonical tensor ("embed", "norm", "lm_head", "rope_freqs", "<i>.q", "<i>.q_bias", ...)
# on the device and in the dtype asked for, or None when the file does not have it. It reads and converts that
# one tensor, so a load never holds more than the finished weights and the tensor in hand.
Getter = Callable[[str, torch.device, torch.dtype], "torch.Tensor | None"]
# A groups getter returns a weight the file already holds as 4-bit groups of 32 as (codes, scale, minimum)
# (int4.Int4Weight.from_groups), or None when the file holds it otherwise (then it is read with the Getter).
Groups = int4.Groups
GroupsGetter = moe_loading.GroupsGetter
# Whether the file holds a tensor in a block type of more than 4 bits a weight (gguf_dequant.WIDE).
WideGetter = Callable[[str], bool]
# Dense projections kept in the file's rows when the file holds them so (kquant_weight.py).
FILE_ROWS = ("Q4_K", "Q8_0")


def _skipping(groups: GroupsGetter, skip: Callable[[str], bool]) -> GroupsGetter:
    """`groups` without the keys `skip` names (read as tensors instead)."""
    return lambda key: None if skip(key) else groups(key)


def _skipping_all(kquant: moe_loading.KQuantGetter, skip: Callable[[str], bool]) -> moe_loading.KQuantGetter:
    """`kquant` declining a set of keys of which `skip` names one (read as tensors instead)."""
    return lambda keys, kinds: None if any(skip(k) for k in keys) else kquant(keys, kinds)


def build_model(
    config: ModelConfig,
    stages: list[tuple[torch.device, int, int]],
    dtype: torch.dtype,
    get: Getter,
    path: str,
    *,
    int4_weights: bool = False,
    groups: GroupsGetter | None = None,
    kquant: moe_loading.KQuantGetter | None = None,
    wide: WideGetter | None = None,
    cpu_experts: frozenset[int] = frozenset(),
    blocks: BlocksGetter | None = None,
    derived: DerivedWeights | None = None,
) -> CausalLM:
    """The model from `get`'s tensors; with `int4_weights` its CPU projections and output matrix are built
    as 4-bit groups straight away (from `groups` where the file has them, else quantised tensor by tensor), or
    as 8-bit rows where `wide` says the file holds one of the parts with more bits and the native kernels load.
    The routed experts of the layers in `cpu_experts` stay in host RAM as 4-bit groups whatever the layer's
    device (engine/model/moe_placement.py); expert stacks `kquant` finds in Q4_K, Q6_K or Q8_0 stay in the
    file's blocks. `blocks` gives the embedding table as the file's quantised blocks
    (engine/model/quant_embedding.py). `derived` holds 4-bit weights from an earlier load of the same file, and
    collects the ones built here (engine/model/weights_cache.py)."""
    _stage_checks(config, stages, path)
    assert not int4_weights or dtype == torch.float32, "int4 weights take float32 activations"
    c = config
    folded = moe_loading.fold_scales(c, get)  # GraniteMoE's multipliers into the weights; `get` itself elsewhere
    if folded is not get:
        get, groups, kquant, blocks = folded, None, None, None  # a file's own blocks would bypass the folding
    cpu = torch.device("cpu")
    if c.mla is not None:  # RoPE'd rows in interleaved pairs reordered to rotate-half (engine/model/mla.py)
        get, reordered = mla.rope_rows_in_halves(c.mla, c.n_heads, mla.kv_b_joined(get))
        if groups is not None:
            groups = _skipping(groups, reordered)
        if kquant is not None:
            kquant = _skipping_all(kquant, reordered)

    def need(key: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        t = get(key, device, dtype)
        if t is None:
            raise ModelLoadError(f"{path}: weight {key!r} is missing")
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{path}: weight {key!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.contiguous()

    def projection(
        name: str, parts: list[tuple[str, tuple[int, int]]], device: torch.device
    ) -> torch.Tensor | Int4Weight | RowsWeight:
        """The weights `parts` stacked by rows: float, or with int4 weights on the CPU the file's own Q4_K or
        Q8_0 rows (`file_rows`), else 4-bit groups, or 8-bit rows where the file holds a part with more than 4
        bits (engine/model/q8_weight.py)."""
        rows, cols = sum(shape[0] for _, shape in parts), parts[0][1][1]
        if not (int4_weights and device.type == "cpu" and int4.can_pack(rows, cols)):
            ws = [need(key, shape, device) for key, shape in parts]
            return ws[0] if len(ws) == 1 else torch.cat(ws)
        cached = derived.get(name, (rows, cols)) if derived is not None else None
        if cached is not None:
            return cached
        as_read = file_rows(parts) if kquant is not None and device.type == "cpu" else None
        if as_read is not None:
            return as_read
        if wide is not None and any(wide(key) for key, _ in parts) and q8_weight.available():
            if [key for key, _ in parts] == ["embed"] and isinstance(embed, QuantEmbedding):
                if embed.qtype == GGMLQuantizationType.Q6_K:
                    eight = Q8Weight(kquant_weight.q6k_to_q8_0(embed.blocks, (rows, cols)), (rows, cols))
                else:  # a slice of rows at a time: no float table at once
                    eight = Q8Weight(torch.cat([q8_weight.q8_0_rows(embed(torch.arange(a, min(a + 4096, rows))))
                                                for a in range(0, rows, 4096)]), (rows, cols))
            else:  # Q8_0 rows are per row: the parts' rows one after the other are the fused matrix's
                eight = Q8Weight(torch.cat([eight_bit_rows(key, shape, device) for key, shape in parts]), (rows, cols))
            if derived is not None:
                derived.put(name, eight)
            return eight
        stacked: list[Groups] = []
        for key, shape in parts:
            found = groups(key) if groups is not None else None
            if found is None and key == "embed" and device == first_device:
                found = embed.int4_groups() if isinstance(embed, QuantEmbedding) else int4.quantize_groups(embed)
            elif found is None:
                found = int4.quantize_groups(need(key, shape, device))
            elif tuple(found[0].shape) != shape:
                raise ModelLoadError(f"{path}: weight {key!r} has shape {tuple(found[0].shape)}, expected {shape}")
            stacked.append(found)
        codes, scale, minimum = (torch.cat(p) for p in zip(*stacked, strict=True))
        built = Int4Weight.from_groups(codes, scale, minimum, dtype=dtype)
        if derived is not None:
            derived.put(name, built)
        return built

    def eight_bit_rows(key: str, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        """A part's Q8_0 rows: a Q6_K tensor's converted natively from the file's blocks, any other from its
        float values (the same bytes either way)."""
        found = kquant([key], ("Q6_K",)) if kquant is not None else None
        if found is None:
            return q8_weight.q8_0_rows(need(key, shape, device))
        blocks = found[1][0]
        if tuple(blocks.shape) != (shape[0], kquant_weight.row_bytes(shape[1], "Q6_K")):
            raise ModelLoadError(f"{path}: weight {key!r} has Q6_K rows {tuple(blocks.shape)}, expected {shape[0]} of "
                                 f"{shape[1]} values")
        return kquant_weight.q6k_to_q8_0(blocks, shape)

    def file_rows(parts: list[tuple[str, tuple[int, int]]]) -> RowsWeight | None:
        """The parts as the file's own rows where it holds all of them as Q4_K or as Q8_0, which the native kernels
        multiply as they are: the file's values, nothing converted, nothing to keep in the weights cache. Q6_K
        parts still become Q8_0 rows (faster per token, kquant_weight.py)."""
        if any(key == "embed" for key, _ in parts):  # a tied output matrix: the table's own blocks (q8_output.py)
            return None
        assert kquant is not None  # the caller checks
        found = kquant([key for key, _ in parts], FILE_ROWS)
        if found is None:
            return None
        kind, blocks = found
        for (key, (n, k)), b in zip(parts, blocks, strict=True):
            if tuple(b.shape) != (n, kquant_weight.row_bytes(k, kind)):
                raise ModelLoadError(f"{path}: weight {key!r} has {kind} rows {tuple(b.shape)}, expected {n} of {k} values")
        rows = blocks[0].contiguous() if len(blocks) == 1 else torch.cat(blocks)
        return kquant_weight.CLASSES[kind](rows, (rows.shape[0], parts[0][1][1]))

    def placeholder(w: torch.Tensor | Int4Weight | QuantEmbedding | RowsWeight) -> torch.Tensor:
        # A module's buffer must be a tensor: an Int4Weight or QuantEmbedding goes in after construction.
        return w if isinstance(w, torch.Tensor) else torch.empty(w.shape, device="meta", dtype=w.dtype)

    first_device, last_device = torch.device(stages[0][0]), torch.device(stages[-1][0])
    hidden, inter = c.hidden_size, c.intermediate_size
    # An untied model has an lm_head (the GGUF and HF readers refuse one without it before this point);
    # GraniteMoE's scaled output is built apart from the embeddings even when they are tied.
    head_key = "embed" if c.tie_word_embeddings and not moe_loading.output_is_separate(c) else "lm_head"
    float_output = head_key == "embed" and not int4_weights and last_device == first_device  # lm_head = embed
    table = kept_table(blocks, first_device, dtype, (c.vocab_size, hidden), path, float_output=float_output)
    embed = table if table is not None else need("embed", (c.vocab_size, hidden), first_device)
    description = describe_layers(c)  # what every executor reads about the layers (engine/model/layers.py)
    layers: list[DecoderLayer] = []
    n_layers = sum(b - a for _, a, b in stages)
    for device, a, b in stages:
        device = torch.device(device)
        for i in range(a, b):
            p = f"{i}."
            spec = description.layers[i]
            kv_heads, head_dim = c.layer_heads(i)  # Gemma 4's global layers may have their own
            q_rows, kv_rows = c.n_heads * head_dim, kv_heads * head_dim
            inter = spec.mlp.size  # twice the model's on Gemma 4's double-wide K/V-sharing layers
            # The order of the reads is the order of the weights in the fingerprint: keep it.
            latent = None
            if c.mla is not None:  # the query's first projection and kv_a as one (engine/model/mla.py)
                m = c.mla
                q_first = (p + ("q" if m.q_lora_rank is None else "q_a"), (m.q_rows(c.n_heads), hidden))
                w = {"wqkv": projection(p + "wqkv", [q_first, (p + "kv_a", (m.latent_width, hidden))], device)}
                q_b = q_a_norm = None
                if m.q_lora_rank is not None:
                    q_a_norm = need(p + "q_a_norm", (m.q_lora_rank,), device)
                    q_b = need(p + "q_b", (c.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank), device)
                latent = mla.MlaAttention(
                    m, c.n_heads, kv_a_norm=need(p + "kv_a_norm", (m.kv_lora_rank,), device),
                    kv_b=need(p + "kv_b", (c.n_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), device),
                    q_a_norm=q_a_norm, q_b=q_b)
            else:
                # Gemma 4's global layers with attention_k_eq_v take their values from the key projection; a
                # Gemma 4 layer that reads an earlier layer's K/V projects q alone.
                v_key = p + ("k" if c.attention_k_eq_v and spec.attention.window is None else "v")
                qkv_parts = [(p + "q", (q_rows, hidden))]
                if spec.kv_source is None:
                    qkv_parts += [(p + "k", (kv_rows, hidden)), (v_key, (kv_rows, hidden))]
                w = {"wqkv": projection(p + "wqkv", qkv_parts, device)}
            bqkv = None
            if spec.attention.bias:
                bqkv = torch.cat((need(p + "q_bias", (q_rows,), device), need(p + "k_bias", (kv_rows,), device),
                                  need(p + "v_bias", (kv_rows,), device)))

            def sparse_block(block_shape: moe_loading.MoeShape, d: torch.device = device, index: int = i) -> moe.SparseMoe:
                """Layer i's router and routed experts, the experts in host RAM when placed there."""
                def to_layer(weight: torch.Tensor) -> torch.Tensor:
                    return weight.to(device=d, dtype=dtype).contiguous()

                def to_host(weight: torch.Tensor) -> torch.Tensor:  # experts placed in host RAM never visit `device`
                    return weight.to(device=cpu, dtype=dtype).contiguous()

                # Experts that end up as 4-bit groups take a Q4 file's own codes, not a float round trip.
                packed = index in cpu_experts or (int4_weights and d.type == "cpu")
                return moe_loading.build_sparse_moe(
                    block_shape, index, lambda key: get(key, cpu, dtype), lambda key, shape: need(key, shape, cpu),
                    to_layer, path, to_experts=to_host if index in cpu_experts else to_layer, groups=groups if packed else None,
                    kquant=kquant if packed else None, dtype=dtype,
                )

            routed = None
            if spec.mlp.experts is not None:  # a sparse expert block instead of the dense MLP
                routed = sparse_block(c)
            else:
                w["w_gate_up"] = projection(p + "w_gate_up", [(p + "gate", (inter, hidden)), (p + "up", (inter, hidden))], device)
            q_norm = k_norm = None
            if spec.attention.qk_norm != "none":
                q_shape, k_shape = moe_loading.q_norm_shapes(c, head_dim)
                q_norm = need(p + "q_norm", q_shape, device)
                k_norm = need(p + "k_norm", k_shape, device) if spec.kv_source is None else None
            attn_norm = need(p + "attn_norm", (hidden,), device)
            o_cols = q_rows if c.mla is None else c.n_heads * c.mla.v_head_dim
            w["wo"] = projection(p + "wo", [(p + "o", (hidden, o_cols))], device)
            mlp_norm = need(p + "mlp_norm", (hidden,), device)
            if routed is None:
                w["w_down"] = projection(p + "w_down", [(p + "down", (hidden, inter))], device)
            post: dict[str, Any] = {}
            if spec.norm.post:  # the norms on the attention and MLP outputs
                post = {name: need(p + name, (hidden,), device) for name in ("post_attn_norm", "post_mlp_norm")}
            if spec.scaled:  # Gemma 4's scalar on the layer's output
                post["layer_scalar"] = need(p + "layer_scalar", (1,), device)
            expert_block = routed
            if spec.parallel_experts:  # Gemma 4's expert block beside the dense MLP: the shared block inside
                expert_block = sparse_block(ExpertShape(routed_config(c.parallel_experts), hidden))
                post["experts"] = Gemma4Experts(
                    routed=expert_block, eps=c.rms_norm_eps, router_scale=need(p + "router_scale", (hidden,), device),
                    expert_scale=need(p + "expert_scale", (c.parallel_experts[0],), device),
                    pre_norm=need(p + "experts_norm", (hidden,), device),
                    post_mlp_norm=need(p + "post_mlp_norm_1", (hidden,), device),
                    post_experts_norm=need(p + "post_experts_norm", (hidden,), device))
            if (width := spec.per_layer_input) > 0:  # Gemma 4's per-layer input: its gate, projection and norm
                post["per_layer"] = (need(p + "ple_gate", (width, hidden), device),
                                     need(p + "ple_proj", (hidden, width), device), need(p + "ple_norm", (hidden,), device))
            if spec.attention.sinks:  # gpt-oss
                post["sinks"] = need(p + "sinks", (c.n_heads,), device)
            if spec.attention.out_bias:
                post["bo"] = need(p + "o_bias", (hidden,), device)
            # w_gate_up/w_down None: the experts replace them (the cast: a dict of mixed keyword values).
            layer = DecoderLayer(c, spec, attn_norm=attn_norm, bqkv=bqkv, mlp_norm=mlp_norm, q_norm=q_norm, k_norm=k_norm,
                                 moe=routed, mla=latent, **post, **cast(dict[str, Any], {"w_gate_up": None, "w_down": None}
                                                 | {name: placeholder(t) for name, t in w.items()}))
            for name, t in w.items():
                if isinstance(t, (Int4Weight, RowsWeight)):
                    int4.install(layer, name, t)
            if expert_block is not None and int4_weights and device.type == "cpu":
                expert_block.quantize_experts()  # the experts as 4-bit groups, one Int4Weight per expert and matrix
            elif expert_block is not None and i in cpu_experts:
                expert_block.quantize_experts(shared=False)  # the shared expert runs where the layer runs, as it is
            layers.append(layer)
            # The layer's temporaries were freed among the kept weights; without this the heap keeps their
            # pages (~100 MB for SmolLM2 in int4, half its weights).
            release_freed_memory()
            startup_progress.report(len(layers), n_layers)  # GET /health shows the fraction while loading
    norm = need("norm", (hidden,), last_device)
    lm_head: torch.Tensor | Int4Weight | RowsWeight
    if int4_weights and head_key == "embed" and last_device == first_device and q8_output.can_read(embed):
        assert isinstance(embed, QuantEmbedding)
        lm_head = Q8Output(embed)  # the file's Q8_0 blocks, shared with the token lookup
    elif float_output:
        assert isinstance(embed, torch.Tensor)  # kept_table keeps no blocks for a float output
        lm_head = embed
    elif head_key == "embed" and not int4_weights:
        lm_head = need("embed", (c.vocab_size, hidden), last_device)
    else:
        lm_head = projection("lm_head", [(head_key, (c.vocab_size, hidden))], last_device)
    freq_factors = get("rope_freqs", torch.device("cpu"), torch.float32)
    if freq_factors is None and c.rope_pairs is not None:  # Gemma 4's proportional RoPE from config.json
        freq_factors = proportional_factors(c.global_head_dim or c.head_dim, c.rope_pairs)
    per_layer = None
    if (width := c.per_layer_input) > 0:  # Gemma 4's per-layer input embeddings (per_layer_inputs.py)
        ple_rows = c.n_layers * width
        # The per-layer table stays in host RAM whatever the first device (E2B's is 262144 x 8960): only the
        # looked-up rows travel, as llama.cpp keeps it.
        per_layer = PerLayerInputs(need("ple_embed", (c.per_layer_vocab, ple_rows), cpu),
                                   need("ple_model_proj", (ple_rows, hidden), first_device),
                                   need("ple_proj_norm", (width,), first_device), c.n_layers, c.rms_norm_eps)
    model = CausalLM(c, stages, description=description, embed=placeholder(embed), layers=layers, norm=norm, lm_head=placeholder(lm_head),
                     rope_freq_factors=freq_factors, per_layer=per_layer)
    if isinstance(embed, QuantEmbedding):
        int4.install(model, "embed", embed)
    if isinstance(lm_head, (Int4Weight, RowsWeight)):
        int4.install(model, "lm_head", lm_head)
    release_freed_memory()
    if moe_offload.offloads(layers):  # experts in host RAM that long batches bring to the GPU: lock their pages
        pinned = moe_offload.pin_host_experts(layers)
        log.info("experts in host RAM: %.2f GiB page-locked for their copies to the GPU", pinned / 2**30)
    return model
