"""The next-token (MTP) layer of the latent-attention families (DeepSeek-V3 `deepseek_v3`, GLM-4.7-Flash
`glm4_moe_lite`): its logits against the same layer composed from transformers' own modules, `--spec mtp` drafting
with it token-identical to `--spec off`, and its latent rows parked with the conversation (tiny random models
with one MTP layer, tests/mla_fixtures.py)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # float32 on both sides; the absorbed attention only sums in another order (engine/model/mla.py)
FIRST = list(range(5, 45))
OTHER = [9, 10, 11] * 12


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe_lite"])
def folder(request, tmp_path_factory) -> str:
    from tests.mla_fixtures import write_tiny_mla_model

    return write_tiny_mla_model(tmp_path_factory.mktemp(request.param), request.param, seed=3, mtp=True)


def _load(folder: str):
    from engine.model import load_model, plan_stages
    from engine.model.loader import read_model_config

    return load_model(folder, plan_stages(read_model_config(folder).n_layers, "cpu", ""), torch.float32)


def _modules(arch: str):
    """transformers' decoder layer, RMSNorm and rotary embedding classes of `arch`."""
    if arch == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        return m.DeepseekV3DecoderLayer, m.DeepseekV3RMSNorm, m.DeepseekV3RotaryEmbedding
    from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as g

    return g.Glm4MoeLiteDecoderLayer, g.Glm4MoeLiteRMSNorm, g.Glm4MoeLiteRotaryEmbedding


def _reference(folder: str, next_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, the layer's output rows) of the MTP layer over a whole sequence, by transformers' modules:
    eh_proj([enorm(embed); hnorm(hidden)]), the decoder layer (MLA, then the MoE block), shared_head.norm, head."""
    from safetensors.torch import load_file

    cfg = transformers.AutoConfig.from_pretrained(folder)
    decoder, rms_norm, rotary = _modules(cfg.model_type)
    tensors = load_file(f"{folder}/model.safetensors")
    n_layers, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    p = f"model.layers.{n_layers}."
    # built as the last decoder layer (a sparse one: GLM-4.7-Flash's mlp_layer_types lists the decoder's only)
    layer = decoder(cfg, layer_idx=n_layers - 1).eval()
    own = {k[len(p):]: t for k, t in tensors.items() if k.startswith(p)}
    if "mlp.experts.0.gate_proj.weight" in own:  # the checkpoint holds each expert's matrices; the layer stacks them
        experts = range(cfg.n_routed_experts)
        own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat((own[f"mlp.experts.{j}.gate_proj.weight"],
                                                                  own[f"mlp.experts.{j}.up_proj.weight"]))
                                                       for j in experts])
        own["mlp.experts.down_proj"] = torch.stack([own[f"mlp.experts.{j}.down_proj.weight"] for j in experts])
    missing, _ = layer.load_state_dict(own, strict=False)
    assert not missing, missing

    def norm(name: str):
        module = rms_norm(cfg.hidden_size, eps)
        module.weight.data.copy_(tensors[p + name + ".weight"])
        return module

    embed = tensors["model.embed_tokens.weight"]
    head = tensors["lm_head.weight"]
    n = next_ids.shape[0]
    positions = torch.arange(n)[None]
    with torch.no_grad():
        x = torch.cat((norm("enorm")(embed[next_ids]), norm("hnorm")(hidden)), -1) @ tensors[p + "eh_proj.weight"].T
        rope = rotary(cfg)(x[None], positions)
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x[None], attention_mask=causal, position_ids=positions, position_embeddings=rope)
        out = (out[0] if isinstance(out, tuple) else out)[0]
        out = norm("shared_head.norm")(out)
        return out @ head.T, out


def test_the_latent_next_token_layer_computes_what_transformers_modules_do(folder):
    from engine.model.mtp_layer import MtpBlock

    lm = _load(folder)
    c = lm.config
    (kept,) = lm.model.mtp
    block = MtpBlock(lm.model, kept)
    assert block.kv_shape == (1, c.mla.store_width)  # the latent's halves, as the model stores its own rows
    torch.manual_seed(0)
    n = 20
    next_ids = torch.randint(0, c.vocab_size, (n,))
    hidden = torch.randn(n, c.hidden_size)
    ref_logits, ref_out = _reference(folder, next_ids, hidden)
    logits, out = block.forward(next_ids, hidden, 0, block.new_cache(32))
    assert (out - ref_out).abs().max().item() <= ATOL
    assert (logits - ref_logits).abs().max().item() <= ATOL
    # in pieces on its own latent rows (a prefill chunk, then one row at a time, as drafting runs)
    cache = block.new_cache(32)
    got = [block.forward(next_ids[:8], hidden[:8], 0, cache)[0]]
    got += [block.forward(next_ids[i : i + 1], hidden[i : i + 1], i, cache)[0] for i in range(8, n)]
    assert (torch.cat(got) - ref_logits).abs().max().item() <= ATOL
    # a context cut short (rows from `first` on): as the layer run over those rows alone, shifted
    cut = block.new_cache(32)
    block.forward(next_ids[:6], hidden[:6], 0, cut)
    alone, _ = block.forward(next_ids[6:12], hidden[6:12], 6, cut, 6)
    fresh, _ = block.forward(next_ids[6:12], hidden[6:12], 0, block.new_cache(32))
    assert (alone - fresh).abs().max().item() <= ATOL


def _engine_config(folder: str, spec: str, storage: str = "off"):
    from engine.config import EngineConfig

    return EngineConfig(model=folder, ctx_size=256, cpu_weights="float", spec=spec, conversation_cache_storage=storage,
                        conversation_cache_min_free_mib=0)


def _switch_back(config) -> tuple[list[int], list[int], object]:
    """A first turn, another conversation taking the one slot (the first is parked), then the first's next turn:
    (first answer, second answer, the second request's record)."""
    from engine.runtime.engine import Engine
    from engine.runtime.requests import GenerationRequest, SamplingParams

    engine = Engine.from_config(config)
    try:
        def answer(name: str, prompt: list[int], max_tokens: int = 12) -> list[int]:
            events = engine.submit(GenerationRequest(name, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
            return [e.token_id for e in events if e.token_id is not None]

        first = answer("first", FIRST)
        answer("other", OTHER, 4)
        again = answer("again", FIRST + first + [12, 13, 14, 15])
        return first, again, engine.call(lambda: engine.stats.requests.snapshot()[-1]).result()
    finally:
        engine.close()


def test_spec_mtp_drafts_token_identical_and_a_parked_conversation_drafts_at_once(folder):
    off = _switch_back(_engine_config(folder, "off", "ram"))
    on = _switch_back(_engine_config(folder, "mtp", "ram"))
    assert on[:2] == off[:2]  # the target's own answers, token for token
    record = on[2]
    assert record.source == "ram" and record.reused_tokens >= len(FIRST) + len(on[0]) - 1, record
    # the layer's latent rows came back with the conversation: it read none of them again and drafted at once
    assert record.spec_draft_reused == record.reused_tokens and record.spec_drafted > 0, record


def test_the_layer_s_parked_part_costs_the_latent_s_bytes(folder):
    from engine.kv import KVBuffers, KVLayout
    from engine.runtime.draft_states import mtp_identity
    from engine.runtime.identity import cache_identity, int4_kernel
    from engine.runtime.memory import AttentionMemory
    from engine.runtime.mtp_drafts import MtpSource

    lm = _load(folder)
    c = lm.config
    kv = KVBuffers(KVLayout(c.n_layers, c.kv_row[0], c.kv_row[1], lm.dtype), 1, 64, lm.model.stages)
    model = cache_identity(lm, "float", int4_kernel(lm.model, "float"), kv.layout, 16, AttentionMemory(kv))
    try:
        ident = mtp_identity(model, MtpSource(lm.model, 1, 64))
    finally:
        lm.model.hidden_rows = None
    assert ident.key != model.key and ident.model["role"] == "mtp"
    # float32: the latent (its two halves) and the target's hidden row, not per-head keys and values
    assert ident.bytes_per_token == 2 * c.mla.store_width * 4 + c.hidden_size * 4


def test_the_layer_built_from_a_deepseek2_gguf_computes_as_from_the_folder(tmp_path):
    """llama.cpp's deepseek2 file: RoPE rows interleaved, kv_b split into attn_k_b / attn_v_b, read as the
    decoder layers' are."""
    from engine.model.mtp_layer import MtpBlock
    from tests.mla_fixtures import write_tiny_mla_gguf

    path = write_tiny_mla_gguf(tmp_path, "glm4_moe_lite", seed=3, mtp=True)
    models = [_load(p) for p in (path.removesuffix(".gguf"), path)]
    blocks = [MtpBlock(m.model, m.model.mtp[0]) for m in models]
    torch.manual_seed(1)
    next_ids, hidden = torch.randint(0, models[0].config.vocab_size, (12,)), torch.randn(12, models[0].config.hidden_size)
    (a, ha), (b, hb) = (block.forward(next_ids, hidden, 0, block.new_cache(16)) for block in blocks)
    assert (ha - hb).abs().max().item() <= ATOL and (a - b).abs().max().item() <= ATOL


def test_a_latent_next_token_layer_missing_a_tensor_is_refused(folder):
    from engine.errors import ModelLoadError
    from engine.model.mtp_layer import MtpBlock

    lm = _load(folder)
    (kept,) = lm.model.mtp
    with pytest.raises(ModelLoadError, match=r"next-token layer 3: the tensor kv_b is missing"):
        MtpBlock(lm.model, {k: t for k, t in kept.items() if k != "kv_b"})
