"""GLM-4.x MoE's next-token (MTP) layer, run from the tensors the loader keeps, against the same layer computed with
transformers' own modules (its decoder layer, RMSNorm and rotary embedding) on a tiny random checkpoint."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # float32 on both sides; only summation orders differ


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tests.moe_fixtures import write_tiny_moe_model

    return write_tiny_moe_model(tmp_path_factory.mktemp("glm4-mtp"), "glm4_moe", seed=3)


@pytest.fixture(scope="module")
def lm(folder):
    from engine.model import load_model, plan_stages
    from engine.model.loader import read_model_config

    return load_model(folder, plan_stages(read_model_config(folder).n_layers, "cpu", ""), torch.float32)


def _reference(folder: str, next_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, the layer's output rows) of the MTP layer over a whole sequence, by transformers' modules."""
    from safetensors.torch import load_file
    from transformers.models.glm4_moe.modeling_glm4_moe import (
        Glm4MoeDecoderLayer,
        Glm4MoeRMSNorm,
        Glm4MoeRotaryEmbedding,
    )

    cfg = transformers.AutoConfig.from_pretrained(folder)
    tensors = load_file(f"{folder}/model.safetensors")
    n_layers, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    p = f"model.layers.{n_layers}."
    layer = Glm4MoeDecoderLayer(cfg, layer_idx=n_layers).eval()
    own = {k[len(p):]: t for k, t in tensors.items() if k.startswith(p)}
    # the checkpoint holds each expert's matrices; transformers' layer stacks them
    experts = range(cfg.n_routed_experts)
    own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat((own[f"mlp.experts.{j}.gate_proj.weight"],
                                                              own[f"mlp.experts.{j}.up_proj.weight"])) for j in experts])
    own["mlp.experts.down_proj"] = torch.stack([own[f"mlp.experts.{j}.down_proj.weight"] for j in experts])
    missing, _ = layer.load_state_dict(own, strict=False)
    assert not missing

    def norm(name: str) -> Glm4MoeRMSNorm:
        module = Glm4MoeRMSNorm(cfg.hidden_size, eps)
        module.weight.data.copy_(tensors[p + name + ".weight"])
        return module

    embed = tensors["model.embed_tokens.weight"]
    head = tensors.get("lm_head.weight", embed)
    n = next_ids.shape[0]
    positions = torch.arange(n)[None]
    with torch.no_grad():
        x = torch.cat((norm("enorm")(embed[next_ids]), norm("hnorm")(hidden)), -1) @ tensors[p + "eh_proj.weight"].T
        rope = Glm4MoeRotaryEmbedding(cfg)(x[None], positions)
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x[None], attention_mask=causal, position_ids=positions, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        out = out[0]
        out = norm("shared_head.norm")(out)
        return out @ head.T, out


def test_the_next_token_layer_computes_what_transformers_modules_do(folder, lm):
    from engine.model.mtp_layer import MtpBlock

    (kept,) = lm.model.mtp
    block = MtpBlock(lm.model, kept)
    torch.manual_seed(0)
    n = 24
    next_ids = torch.randint(0, lm.config.vocab_size, (n,))
    hidden = torch.randn(n, lm.config.hidden_size)
    ref_logits, ref_out = _reference(folder, next_ids, hidden)
    cache = block.new_cache(32)
    logits, out = block.forward(next_ids, hidden, 0, cache)
    assert logits.shape == (n, lm.config.vocab_size) and logits.dtype == torch.float32
    assert (out - ref_out).abs().max().item() <= ATOL
    assert (logits - ref_logits).abs().max().item() <= ATOL
    # in pieces on its own K/V (a prefill chunk, then one row at a time, as drafting runs) it computes the same
    cache = block.new_cache(32)
    got = [block.forward(next_ids[:10], hidden[:10], 0, cache)[0]]
    got += [block.forward(next_ids[i : i + 1], hidden[i : i + 1], i, cache)[0] for i in range(10, n)]
    assert (torch.cat(got) - ref_logits).abs().max().item() <= ATOL


def test_a_next_token_layer_missing_a_tensor_or_past_its_rows_is_refused(lm):
    from engine.errors import ModelLoadError
    from engine.model.mtp_layer import MtpBlock

    (kept,) = lm.model.mtp
    with pytest.raises(ModelLoadError, match=r"next-token layer 4: the tensor nextn.enorm is missing"):
        MtpBlock(lm.model, {k: t for k, t in kept.items() if k != "nextn.enorm"})
    block = MtpBlock(lm.model, kept)
    with pytest.raises(ValueError, match=r"positions up to 5 do not fit its 4 rows"):
        block.forward(torch.zeros(5, dtype=torch.int64), torch.zeros(5, lm.config.hidden_size), 0, block.new_cache(4))


def test_a_layer_too_large_for_the_free_ram_is_declined_before_it_is_built(lm):
    """With --cpu-weights float the layer runs in float32: a large expert block (DeepSeek-V3's: ~45 GiB) is declined
    with its size, not built until the machine runs out of memory (4-bit experts: tests/test_mtp_int4.py)."""
    from engine.model.mtp_experts import held_bytes
    from engine.runtime.mtp_drafts import declines

    (kept,) = lm.model.mtp
    need = held_bytes(kept, int4_experts=False)
    assert need == 4 * sum(t.data.numel() for t in kept.values())  # the folder's bfloat16 or float32 values
    assert declines(lm.model, available=2 * need + 1) == ""
    why = declines(lm.model, available=need)
    assert why.startswith(f"its next-token layer needs {need / 2**30:.1f} GiB as float32, more than half the")


# ---------------------------------------------------------------- drafting with it (--spec mtp)

def _greedy(block, next_ids: list[int], rows: torch.Tensor, k: int) -> list[int]:
    """The layer's k greedy tokens after its rows 0 .. len-1 (one shot), each next from its own output row."""
    cache = block.new_cache(128)
    logits, out = block.forward(torch.tensor(next_ids), rows, 0, cache)
    tokens, hidden = [int(logits[-1].argmax())], out[-1:]
    while len(tokens) < k:
        logits, hidden = block.forward(torch.tensor(tokens[-1:]), hidden, len(next_ids) - 1 + len(tokens), cache)
        tokens.append(int(logits[0].argmax()))
    return tokens


def test_the_drafts_are_the_layer_s_greedy_tokens_over_the_target_s_rows(lm):
    from engine.kv import KVBuffers, KVLayout
    from engine.model import SeqChunk
    from engine.model.mtp_layer import MtpBlock
    from engine.runtime.mtp_drafts import MtpSource

    c = lm.config
    kv = KVBuffers(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim, lm.dtype), 2, 128, lm.model.stages)
    source = MtpSource(lm.model, 2, 128)
    block = MtpBlock(lm.model, lm.model.mtp[0])
    seq = [(7 * i) % 300 + 3 for i in range(30)]
    try:
        lm.model.forward_chunks([SeqChunk(1, 0, torch.tensor(seq[:20]))], kv)
        rows = source.target.rows[1]
        assert rows.shape[0] < 128 and rows.dtype == lm.dtype  # grown with what the slot holds
        assert source.propose(1, seq[:21], 3) == _greedy(block, seq[1:21], rows[:20], 3)
        assert source.propose(0, seq[:21], 3) == []  # rows never computed here (as a restored slot's): no drafts
        for p in range(20, 25):  # decoding on: it reads only the rows added, and the same tokens come out
            lm.model.forward_chunks([SeqChunk(1, p, torch.tensor(seq[p : p + 1]))], kv)
        rows = source.target.rows[1]
        assert source.propose(1, seq[:26], 4) == _greedy(block, seq[1:26], rows[:25], 4)
        assert source.held[1] == seq[:26]
        # a rejected draft's rows are read again with the sequence's own tokens
        assert source.propose(1, seq[:23], 2) == _greedy(block, seq[1:23], rows[:22], 2)
    finally:
        lm.model.hidden_rows = None

def greedy_answers(config, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
    """Each prompt's greedy answer on an engine of `config`, and the engine's counters after them."""
    from engine.runtime.engine import Engine
    from engine.runtime.requests import GenerationRequest, SamplingParams

    engine = Engine.from_config(config)
    try:
        out = []
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            events = engine.submit(GenerationRequest(f"mtp-{i}", prompt, params))
            out.append([e.token_id for e in events if e.token_id is not None])
        return out, engine.call(lambda: dict(engine.stats.counters)).result()
    finally:
        engine.close()


def test_spec_mtp_drafts_with_the_layer_and_answers_token_identical(folder):
    from engine.config import EngineConfig

    config = EngineConfig(model=folder, ctx_size=256, cpu_weights="float")
    prompts = [list(range(5, 40)), [7, 8, 9] * 10]
    off, _ = greedy_answers(config, prompts, 24)
    on, counters = greedy_answers(config.replace(spec="mtp"), prompts, 24)
    assert on == off
    assert counters["spec_drafted_tokens"] > 0, counters  # proposed and verified (random weights: few accepted)


def test_with_4_bit_weights_the_native_step_hands_the_layer_its_rows(folder):
    """With int4 weights GLM's decode steps run in step.c (the native step): it hands over the rows the logits are
    taken from as the eager forward does, so --spec mtp drafts there too, token-identical to off."""
    from engine.config import EngineConfig
    from engine.runtime.engine import Engine

    config = EngineConfig(model=folder, ctx_size=256, cpu_weights="int4")
    engine = Engine.from_config(config)
    try:
        assert type(engine.model.graphs).__name__ == "NativeDecode", engine.model.graphs
    finally:
        engine.close()
    prompts = [list(range(5, 40)), [7, 8, 9] * 10]
    off, _ = greedy_answers(config, prompts, 24)
    on, counters = greedy_answers(config.replace(spec="mtp"), prompts, 24)
    assert on == off
    assert counters["spec_drafted_tokens"] > 0, counters


def test_a_restored_conversation_answers_as_without_drafts(folder):
    from engine.config import EngineConfig
    from engine.runtime.engine import Engine
    from engine.runtime.requests import GenerationRequest, SamplingParams

    def switch_back(config) -> tuple[list[int], list[int], str, dict]:
        engine = Engine.from_config(config)
        try:
            def answer(name: str, prompt: list[int]) -> list[int]:
                params = SamplingParams(temperature=0.0, max_tokens=16)
                return [e.token_id for e in engine.submit(GenerationRequest(name, prompt, params))
                        if e.token_id is not None]

            first = list(range(5, 40))
            one = answer("first", first)
            answer("other", [9, 10, 11] * 8)  # takes the one slot: the first conversation is parked
            two = answer("again", first + one + [12, 13, 14, 15])
            source = engine.call(lambda: engine.stats.requests.snapshot()[-1].source).result()
            return one, two, source, engine.call(lambda: dict(engine.stats.counters)).result()
        finally:
            engine.close()

    config = EngineConfig(model=folder, ctx_size=256, cpu_weights="float", conversation_cache_storage="ram",
                          conversation_cache_min_free_mib=0)
    off, on = switch_back(config), switch_back(config.replace(spec="mtp"))
    assert on[:2] == off[:2] and on[2] == "ram"  # restored from the cache, answered as without drafts
    assert on[3]["spec_drafted_tokens"] > 0, on[3]


def test_spec_mtp_on_a_model_without_the_layer_is_declined_with_the_reason(tmp_path, caplog):
    import logging

    from engine.config import EngineConfig
    from tests.model_fixtures import write_tiny_model

    path = write_tiny_model(tmp_path, "llama")
    config = EngineConfig(model=path, ctx_size=128, cpu_weights="float")
    with caplog.at_level(logging.WARNING, logger="strata.engine"):
        off, _ = greedy_answers(config, [[5, 6, 7, 8]], 6)
        on, counters = greedy_answers(config.replace(spec="mtp"), [[5, 6, 7, 8]], 6)
    assert "--spec mtp declined, decoding without drafts: the model has no next-token (MTP) layers" in caplog.text
    assert on == off and counters["spec_drafted_tokens"] == 0


def test_the_layer_built_from_the_gguf_s_own_bytes_computes_as_from_the_folder(tmp_path):
    from engine.model import load_model, plan_stages
    from engine.model.loader import read_model_config
    from engine.model.mtp_layer import MtpBlock
    from tests.moe_fixtures import write_tiny_moe_gguf

    path = write_tiny_moe_gguf(tmp_path, "glm4_moe")
    models = [load_model(p, plan_stages(read_model_config(p).n_layers, "cpu", ""), torch.float32)
              for p in (path.removesuffix(".gguf"), path)]
    blocks = [MtpBlock(m.model, m.model.mtp[0]) for m in models]
    torch.manual_seed(1)
    next_ids, hidden = torch.randint(0, models[0].config.vocab_size, (12,)), torch.randn(12, models[0].config.hidden_size)
    (a, ha), (b, hb) = (block.forward(next_ids, hidden, 0, block.new_cache(16)) for block in blocks)
    assert (ha - hb).abs().max().item() <= ATOL and (a - b).abs().max().item() <= ATOL
