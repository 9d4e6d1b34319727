"""Write a GGUF of random weights laid out as llama.cpp's Q4_K_M, for load-time and memory measurements.

    python tools/make_random_gguf.py OUT.gguf [--shape 1b|tiny|moe|gpt-oss|glm4moe] [--layers N] [--seed 0]

Shape 1b: Llama-3.2-1B's (hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV heads, tied embeddings)
with the bundled SmolLM2's vocabulary (49152 tokens; every tokenizer.* key is copied from it, so the engine
loads and tokenizes the file), ~1.07 B weights. Types as Q4_K_M assigns them: Q4_K for the projections,
Q6_K for attn_v and ffn_down of every other layer and for the (tied) token embedding, F32 for the norms.
Shape moe: a Qwen3-MoE (hidden 1024, 8 layers of 32 experts of 512, top 4, q/k norms, an F32 router) with
every expert stack (ffn_{gate,up,down}_exps, [experts, rows, cols]) in Q4_K and attention typed as above,
~0.45 B weights of which 0.40 B are experts.
Shape gpt-oss: gpt-oss-20b's layer (hidden 2880, 64 heads of 64 over 8 K/V heads, 32 experts of 2880, top 4,
sliding window 128 on every other layer, q/k/v/o biases, attention sinks, biased router and experts) cut to
--layers layers (2 by default), as ggml-org's gpt-oss GGUFs type it: the expert stacks MXFP4, attention, the
embedding and the output matrix Q8_0, norms, biases, sinks and router F32; ~0.47 B weights a layer.
Shape glm4moe: GLM-4.5-Air's layers (hidden 4096, 96 heads of 128 over 8 K/V heads with q/k/v biases, RoPE on half of
each head, a dense first layer of 10944, then 128 routed experts of 1408, top 8, and one shared expert, a sigmoid
router with its bias) cut to --layers layers (3 by default: the dense one and two with experts), typed as above (Q4_K,
Q6_K for attn_v and ffn_down of every other layer, the embedding and the untied output matrix; ffn_down, 1408 or
10944 wide, as llama-quantize's fallbacks type it, Q8_0 or Q5_0), no MTP layer;
~2.3 B weights a layer with experts.
Block bytes are random except the float16 scale fields, which are small and finite; tensors are written one
at a time, so the writer never holds more than one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gguf  # noqa: E402

from engine.model import embedded_model_path  # noqa: E402

SHAPES = {
    "1b": dict(hidden=2048, inter=8192, layers=16, heads=32, kv_heads=8),
    "tiny": dict(hidden=256, inter=512, layers=2, heads=4, kv_heads=2),
    "moe": dict(hidden=1024, inter=512, layers=8, heads=16, kv_heads=4, experts=32, top_k=4),
    "gpt-oss": dict(hidden=2880, inter=2880, layers=2, heads=64, kv_heads=8, experts=32, top_k=4, head_dim=64),
    "glm4moe": dict(hidden=4096, inter=10944, layers=3, heads=96, kv_heads=8, experts=128, top_k=8, head_dim=128,
                    expert_inter=1408),
}
# Offsets of the float16 fields in one block of the block types written here.
_F16_FIELDS = {gguf.GGMLQuantizationType.Q4_K: (0, 2), gguf.GGMLQuantizationType.Q6_K: (208,),
               gguf.GGMLQuantizationType.Q8_0: (0,), gguf.GGMLQuantizationType.MXFP4: (),
               gguf.GGMLQuantizationType.Q5_0: (0,)}


def random_blocks(rng: np.random.Generator, qtype, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Random blocks of a tensor of `shape` (outermost first), as uint8 [*shape[:-1], bytes per row]."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        raw[:, at : at + 2] = (rng.uniform(0.5, 1.5, n) * scale).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype == gguf.GGMLQuantizationType.MXFP4:  # an e8m0 exponent byte: values up to 6 * 2^(e - 127) ~ scale
        raw[:, 0] = 127 + int(np.round(np.log2(scale / 6)))
    return raw.reshape(*shape[:-1], -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0, help="layers (0: the shape's own)")
    args = ap.parse_args()
    if args.shape == "gpt-oss":
        return write_gpt_oss(args.out, args.layers or SHAPES["gpt-oss"]["layers"], args.seed)
    if args.shape == "glm4moe":
        return write_glm4moe(args.out, args.layers or SHAPES["glm4moe"]["layers"], args.seed)
    s = SHAPES[args.shape]
    h, inter, n_layers, n_heads, n_kv = s["hidden"], s["inter"], s["layers"], s["heads"], s["kv_heads"]
    hd = h // n_heads
    vocab_reader = gguf.GGUFReader(embedded_model_path())
    tok_fields = {k: f for k, f in vocab_reader.fields.items() if k.startswith("tokenizer.")}
    n_vocab = len(tok_fields["tokenizer.ggml.tokens"].contents())

    moe = "experts" in s
    w = gguf.GGUFWriter(args.out, "qwen3moe" if moe else "llama")
    w.add_name(f"random-{args.shape}-q4_k_m")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    if moe:
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_expert_count(s["experts"])
        w.add_expert_used_count(s["top_k"])
        w.add_expert_feed_forward_length(inter)
    for key, f in tok_fields.items():
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub_type=sub)

    q4k, q6k = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    plan: list[tuple[str, tuple[int, ...], object]] = [("token_embd.weight", (n_vocab, h), q6k)]
    for i in range(n_layers):
        p = f"blk.{i}."
        more_bits = q6k if i % 2 == 0 else q4k
        plan += [
            (p + "attn_norm.weight", (h,), None),
            (p + "attn_q.weight", (n_heads * hd, h), q4k),
            (p + "attn_k.weight", (n_kv * hd, h), q4k),
            (p + "attn_v.weight", (n_kv * hd, h), more_bits),
            (p + "attn_output.weight", (h, n_heads * hd), q4k),
            (p + "ffn_norm.weight", (h,), None),
        ]
        if moe:
            e = s["experts"]
            plan += [
                (p + "attn_q_norm.weight", (hd,), None),
                (p + "attn_k_norm.weight", (hd,), None),
                (p + "ffn_gate_inp.weight", (e, h), None),
                (p + "ffn_gate_exps.weight", (e, inter, h), q4k),
                (p + "ffn_up_exps.weight", (e, inter, h), q4k),
                (p + "ffn_down_exps.weight", (e, h, inter), q4k),
            ]
        else:
            plan += [
                (p + "ffn_gate.weight", (inter, h), q4k),
                (p + "ffn_up.weight", (inter, h), q4k),
                (p + "ffn_down.weight", (h, inter), more_bits),
            ]
    plan.append(("output_norm.weight", (h,), None))
    for name, shape, qtype in plan:
        if qtype is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    for _name, shape, qtype in plan:
        if qtype is None and _name.endswith("ffn_gate_inp.weight"):  # a router that tells experts apart
            w.write_tensor_data(rng.standard_normal(shape).astype(np.float32))
        elif qtype is None:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:  # values of about +-0.02 (Q4_K: d * 6-bit scale * 4-bit code; Q6_K: d * int8 scale * (q - 32))
            scale = 0.02 / (32 * 8) if qtype == q4k else 0.02 / (64 * 16)
            w.write_tensor_data(random_blocks(rng, qtype, shape, scale))
    w.close()
    print(f"wrote {args.out}: {len(plan)} tensors, {os.path.getsize(args.out) / 2**20:.0f} MiB, "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def _tokenizer_fields() -> dict:
    reader = gguf.GGUFReader(embedded_model_path())
    return {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _moe_writer(out: str, arch: str, file_type: gguf.LlamaFileType, shape: dict, n_layers: int, ffn: int,
                expert_ffn: int) -> tuple[gguf.GGUFWriter, int]:
    """A writer with the keys the MoE shapes share and the bundled model's tokenizer; and the vocabulary's size."""
    tok_fields = _tokenizer_fields()
    n_vocab = len(tok_fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(out, arch)
    w.add_name(f"random-{arch}")
    w.add_file_type(file_type)
    w.add_context_length(131072)
    w.add_embedding_length(shape["hidden"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_key_length(shape["head_dim"])
    w.add_value_length(shape["head_dim"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_expert_count(shape["experts"])
    w.add_expert_used_count(shape["top_k"])
    w.add_expert_feed_forward_length(expert_ffn)
    for key, f in tok_fields.items():
        vtype = f.types[0]
        w.add_key_value(key, f.contents(), vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    return w, n_vocab


def write_gpt_oss(out: str, n_layers: int, seed: int) -> int:
    """The gpt-oss shape (module docstring) with the bundled model's tokenizer."""
    s = SHAPES["gpt-oss"]
    h, inter, n_heads, n_kv, hd, e = s["hidden"], s["inter"], s["heads"], s["kv_heads"], s["head_dim"], s["experts"]
    w, n_vocab = _moe_writer(out, "gpt-oss", gguf.LlamaFileType.MOSTLY_MXFP4_MOE, s, n_layers, inter, inter)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_sliding_window(128)
    q8, mx = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4
    plan: list[tuple[str, tuple[int, ...], object]] = [("token_embd.weight", (n_vocab, h), q8)]
    for i in range(n_layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (h,), None), (p + "attn_q.weight", (n_heads * hd, h), q8),
                 (p + "attn_q.bias", (n_heads * hd,), None), (p + "attn_k.weight", (n_kv * hd, h), q8),
                 (p + "attn_k.bias", (n_kv * hd,), None), (p + "attn_v.weight", (n_kv * hd, h), q8),
                 (p + "attn_v.bias", (n_kv * hd,), None), (p + "attn_output.weight", (h, n_heads * hd), q8),
                 (p + "attn_output.bias", (h,), None), (p + "attn_sinks.weight", (n_heads,), None),
                 (p + "post_attention_norm.weight", (h,), None), (p + "ffn_gate_inp.weight", (e, h), None),
                 (p + "ffn_gate_inp.bias", (e,), None), (p + "ffn_gate_exps.weight", (e, inter, h), mx),
                 (p + "ffn_gate_exps.bias", (e, inter), None), (p + "ffn_up_exps.weight", (e, inter, h), mx),
                 (p + "ffn_up_exps.bias", (e, inter), None), (p + "ffn_down_exps.weight", (e, h, inter), mx),
                 (p + "ffn_down_exps.bias", (e, h), None)]
    plan += [("output_norm.weight", (h,), None), ("output.weight", (n_vocab, h), q8)]
    return _write_plan(w, out, plan, seed)


def write_glm4moe(out: str, n_layers: int, seed: int) -> int:
    """The GLM-4.5-Air shape (module docstring) with the bundled model's tokenizer, as llama.cpp's converter names and
    keys a `glm4moe` file."""
    s = SHAPES["glm4moe"]
    h, n_heads, n_kv, hd, e, fe = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["experts"], s["expert_inter"]
    w, n_vocab = _moe_writer(out, "glm4moe", gguf.LlamaFileType.MOSTLY_Q4_K_M, s, n_layers, s["inter"], fe)
    w.add_rope_dimension_count(hd // 2)
    w.add_rope_freq_base(1000000.0)
    w.add_expert_shared_count(1)
    w.add_leading_dense_block_count(1)
    w.add_expert_weights_scale(1.0)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_nextn_predict_layers(0)
    q4k, q6k, q8, q5 = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K,
                        gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_0)
    plan: list[tuple[str, tuple[int, ...], object]] = [("token_embd.weight", (n_vocab, h), q6k)]
    for i in range(n_layers):
        p, more_bits = f"blk.{i}.", (q6k if i % 2 == 0 else q4k)
        # 1408 and 10944 columns are not whole 256-value blocks: llama-quantize falls back from Q6_K to Q8_0, Q4_K to Q5_0
        down = q8 if more_bits == q6k else q5
        plan += [(p + "attn_norm.weight", (h,), None), (p + "attn_q.weight", (n_heads * hd, h), q4k),
                 (p + "attn_q.bias", (n_heads * hd,), None), (p + "attn_k.weight", (n_kv * hd, h), q4k),
                 (p + "attn_k.bias", (n_kv * hd,), None), (p + "attn_v.weight", (n_kv * hd, h), more_bits),
                 (p + "attn_v.bias", (n_kv * hd,), None), (p + "attn_output.weight", (h, n_heads * hd), q4k),
                 (p + "post_attention_norm.weight", (h,), None)]
        if i == 0:
            plan += [(p + "ffn_gate.weight", (s["inter"], h), q4k), (p + "ffn_up.weight", (s["inter"], h), q4k),
                     (p + "ffn_down.weight", (h, s["inter"]), down)]
        else:
            plan += [(p + "ffn_gate_inp.weight", (e, h), None), (p + "exp_probs_b.bias", (e,), None),
                     (p + "ffn_gate_exps.weight", (e, fe, h), q4k), (p + "ffn_up_exps.weight", (e, fe, h), q4k),
                     (p + "ffn_down_exps.weight", (e, h, fe), down), (p + "ffn_gate_shexp.weight", (fe, h), q4k),
                     (p + "ffn_up_shexp.weight", (fe, h), q4k), (p + "ffn_down_shexp.weight", (h, fe), down)]
    plan += [("output_norm.weight", (h,), None), ("output.weight", (n_vocab, h), q6k)]
    return _write_plan(w, out, plan, seed)


# Values of about +-0.02 per block type (Q4_K: d * 6-bit scale * 4-bit code; Q6_K: d * int8 scale * (q - 32);
# Q8_0: d * int8 code; Q5_0: d * (q - 16); MXFP4: 2^(e - 127) * e2m1).
_SCALES = {gguf.GGMLQuantizationType.Q4_K: 0.02 / (32 * 8), gguf.GGMLQuantizationType.Q6_K: 0.02 / (64 * 16),
           gguf.GGMLQuantizationType.Q8_0: 0.02 / 128, gguf.GGMLQuantizationType.Q5_0: 0.02 / 16,
           gguf.GGMLQuantizationType.MXFP4: 0.02}


def _write_plan(w: gguf.GGUFWriter, out: str, plan: list[tuple[str, tuple[int, ...], object]], seed: int) -> int:
    """The tensors of `plan` ((name, shape, block type or None for float32)) after the keys already added: random
    blocks, norms of ones, and biases, sinks and routers of values that tell heads and experts apart."""
    for name, shape, qtype in plan:
        if qtype is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for name, shape, qtype in plan:
        if qtype is not None:
            w.write_tensor_data(random_blocks(rng, qtype, shape, _SCALES[qtype]))
        elif name.endswith("norm.weight"):
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            w.write_tensor_data((rng.standard_normal(shape) * (1.0 if "gate_inp.weight" in name else 0.02)).astype(np.float32))
    w.close()
    print(f"wrote {out}: {len(plan)} tensors, {os.path.getsize(out) / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
