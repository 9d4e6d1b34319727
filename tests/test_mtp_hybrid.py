"""The next-token (MTP) layer of Qwen3-Next and Qwen3.5 (hybrids: gated attention, zero-centred norms), kept from
the folder's `mtp.*` tensors, against the same layer composed from transformers' own modules; `--spec mtp` drafting
with it token-identical to `--spec off`, and its state parked and restored with the conversation."""

from __future__ import annotations

import os

import pytest
import torch

from tests.hybrid_fixtures import one_thread  # noqa: F401 (an autouse fixture of this module)
from tests.test_mtp_layer import greedy_answers

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # float32 on both sides; only summation orders differ


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    from tests.hybrid_fixtures import write_tiny_hybrid

    root = tmp_path_factory.mktemp("hybrid-mtp")
    # Qwen3-Next and Qwen3.5-MoE: experts in the layer; Qwen3.5: its dense MLP
    return {arch: write_tiny_hybrid(root, arch, seed=5, mtp=True) for arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe")}


def _load(folder: str):
    from engine.model import load_model, plan_stages
    from engine.model.loader import read_model_config

    return load_model(folder, plan_stages(read_model_config(folder).n_layers, "cpu", ""), torch.float32)


def _reference(folder: str, next_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, the layer's output rows) of the `mtp.*` layer over a whole sequence, by transformers' modules: the
    model's own decoder layer class (full attention), RMSNorm (1 + w) and rotary embedding, composed as llama.cpp's
    qwen3next MTP graph and vLLM's Qwen3-Next MTP compose them."""
    from safetensors.torch import load_file

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg, inner = hf.config, hf.model
    tensors = load_file(f"{folder}/model.safetensors")
    layer = type(inner.layers[1])(cfg, 1).eval()  # layer 1 is full attention, with the MLP kind of the MTP layer
    p = "mtp.layers.0."
    own = {k[len(p):]: t for k, t in tensors.items() if k.startswith(p)}
    experts = range(getattr(cfg, "num_experts", 0))
    if experts:  # the checkpoint holds each expert's matrices; transformers' layer stacks them
        own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat((own.pop(f"mlp.experts.{j}.gate_proj.weight"),
                                                                  own.pop(f"mlp.experts.{j}.up_proj.weight")))
                                                       for j in experts])
        own["mlp.experts.down_proj"] = torch.stack([own.pop(f"mlp.experts.{j}.down_proj.weight") for j in experts])
    missing, unexpected = layer.load_state_dict(own, strict=False)
    assert not missing and not unexpected, (missing, unexpected)

    def norm(name: str) -> torch.nn.Module:
        module = type(inner.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps)
        module.weight.data.copy_(tensors[f"mtp.{name}.weight"])
        return module

    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    n = next_ids.shape[0]
    positions = torch.arange(n)[None]
    with torch.no_grad():
        x = torch.cat((norm("pre_fc_norm_embedding")(embed[next_ids]), norm("pre_fc_norm_hidden")(hidden)), -1)
        x = x @ tensors["mtp.fc.weight"].T
        rope = inner.rotary_emb(x[None], positions)
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x[None], attention_mask=causal, position_ids=positions, position_embeddings=rope)
        out = (out[0] if isinstance(out, tuple) else out)[0]
        out = norm("norm")(out)
        return out @ head.T, out


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_the_hybrid_s_next_token_layer_computes_what_transformers_modules_do(folders, arch):
    from engine.model.mtp_layer import MtpBlock

    lm = _load(folders[arch])
    (kept,) = lm.model.mtp
    block = MtpBlock(lm.model, kept)
    torch.manual_seed(0)
    n = 20
    next_ids = torch.randint(0, lm.config.vocab_size, (n,))
    hidden = torch.randn(n, lm.config.hidden_size)
    ref_logits, ref_out = _reference(folders[arch], next_ids, hidden)
    logits, out = block.forward(next_ids, hidden, 0, block.new_cache(32))
    assert (out - ref_out).abs().max().item() <= ATOL
    assert (logits - ref_logits).abs().max().item() <= ATOL
    # in pieces on its own K/V (a prefill chunk, then one row at a time, as drafting runs) it computes the same
    cache = block.new_cache(32)
    got = [block.forward(next_ids[:8], hidden[:8], 0, cache)[0]]
    got += [block.forward(next_ids[i : i + 1], hidden[i : i + 1], i, cache)[0] for i in range(8, n)]
    assert (torch.cat(got) - ref_logits).abs().max().item() <= ATOL


def test_a_hybrid_without_the_layer_keeps_none_and_one_missing_a_tensor_is_refused(tmp_path, folders):
    from engine.errors import ModelLoadError
    from engine.model.mtp_layer import MtpBlock
    from engine.runtime.mtp_drafts import declines
    from tests.hybrid_fixtures import write_tiny_hybrid

    plain = _load(write_tiny_hybrid(tmp_path, "qwen3_5", seed=5))
    assert plain.model.mtp == () and "no next-token (MTP) layers" in declines(plain.model)
    lm = _load(folders["qwen3_next"])
    (kept,) = lm.model.mtp
    assert not declines(lm.model)
    with pytest.raises(ModelLoadError, match=r"next-token layer 4: the tensor q_norm is missing"):
        MtpBlock(lm.model, {k: t for k, t in kept.items() if k != "q_norm"})


def test_spec_mtp_on_a_hybrid_drafts_and_answers_token_identical(folders):
    from engine.config import EngineConfig

    config = EngineConfig(model=folders["qwen3_next"], ctx_size=256, cpu_weights="float")
    prompts = [list(range(5, 40)), [7, 8, 9] * 10]
    off, _ = greedy_answers(config, prompts, 16)
    on, counters = greedy_answers(config.replace(spec="mtp"), prompts, 16)
    assert on == off
    assert counters["spec_drafted_tokens"] > 0, counters  # proposed and verified (random weights: few accepted)


def test_a_hybrid_s_parked_conversation_restores_the_layer_s_state_and_drafts_at_once(folders):
    from engine.config import EngineConfig
    from engine.runtime.engine import Engine
    from engine.runtime.requests import GenerationRequest, SamplingParams

    first_prompt = list(range(5, 40))

    def switch_back(config) -> tuple[list[int], list[int], object]:
        engine = Engine.from_config(config)
        try:
            def answer(name: str, prompt: list[int]) -> list[int]:
                params = SamplingParams(temperature=0.0, max_tokens=12)
                return [e.token_id for e in engine.submit(GenerationRequest(name, prompt, params))
                        if e.token_id is not None]

            one = answer("first", first_prompt)
            answer("other", [9, 10, 11] * 8)  # takes the one slot: the first conversation is parked
            two = answer("again", first_prompt + one + [12, 13, 14, 15])
            return one, two, engine.call(lambda: engine.stats.requests.snapshot()[-1]).result()
        finally:
            engine.close()

    config = EngineConfig(model=folders["qwen3_next"], ctx_size=256, cpu_weights="float",
                          conversation_cache_storage="ram", conversation_cache_min_free_mib=0)
    off, on = switch_back(config), switch_back(config.replace(spec="mtp"))
    assert on[:2] == off[:2]  # the target's own answers, token for token
    record = on[2]
    parked = len(first_prompt) + len(on[0]) - 1  # the last token sampled was never fed
    assert record.source == "ram" and record.reused_tokens == parked, record
    # the layer read none of the tokens parked, and drafted from its first decode steps
    assert record.spec_draft_reused == parked and record.spec_drafted > 0, record


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_the_layer_from_the_gguf_s_nextn_tensors_computes_as_from_the_folder(tmp_path, arch):
    from engine.model.mtp_layer import MtpBlock
    from tests.hybrid_fixtures import write_tiny_hybrid_gguf

    path = write_tiny_hybrid_gguf(tmp_path, arch, mtp=True)
    models = [_load(p) for p in (os.path.join(tmp_path, f"tiny-{arch}"), path)]
    blocks = [MtpBlock(m.model, m.model.mtp[0]) for m in models]
    torch.manual_seed(1)
    next_ids = torch.randint(0, models[0].config.vocab_size, (12,))
    hidden = torch.randn(12, models[0].config.hidden_size)
    (a, ha), (b, hb) = (block.forward(next_ids, hidden, 0, block.new_cache(16)) for block in blocks)
    assert (ha - hb).abs().max().item() <= ATOL and (a - b).abs().max().item() <= ATOL
