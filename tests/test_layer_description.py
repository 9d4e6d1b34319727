"""The layer description (engine/model/layers.py) and the executors' table (engine/model/executors.py): what each
family's config says per layer, and which executor declines which feature with which reason."""

from pathlib import Path

import pytest

from engine.model import executors
from engine.model.config import ModelConfig
from engine.model.executors import CPU_STEP, EAGER, GRAPH_STEP, NATIVE_STEP, layer_declines
from engine.model.hybrid.attention import attention_spec
from engine.model.hybrid.loader import hybrid_config_from_hf
from engine.model.layers import FEATURES, describe_layers

DETAILS = Path(__file__).resolve().parent.parent / "docs" / "DETAILS.md"


def _hf(arch: str, **cfg) -> ModelConfig:
    base = {"architectures": [arch], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 6,
            "intermediate_size": 128, "vocab_size": 100}
    return ModelConfig.from_hf(base | cfg)


def _experts(**cfg) -> dict:
    return {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32} | cfg


def test_gemma3_layers_are_described_with_their_norms_windows_and_local_rope():
    d = describe_layers(_hf("Gemma3ForCausalLM", head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                            rope_theta=1e6, rope_local_base_freq=1e4))
    sliding, full = d.layers[0], d.layers[5]  # every sixth layer is global
    assert sliding.attention.kind == "sliding" and sliding.attention.window == 8
    assert sliding.attention.rope.local and sliding.attention.rope.theta == 1e4
    assert full.attention.kind == "full" and not full.attention.rope.local and full.attention.rope.theta == 1e6
    assert sliding.norm.post and sliding.norm.stored_offset and sliding.mlp.activation == "gelu_tanh"
    assert sliding.attention.qk_norm == "head" and sliding.attention.scale == 16**-0.5
    assert d.embedding_scale == 64**0.5
    assert d.features() == {"sliding window", "local rope", "per-head q/k norms", "attention scale", "post-norms",
                            "GeGLU", "embedding scale"}


def test_dense_and_expert_families_are_described_as_their_configs_say():
    llama = describe_layers(_hf("LlamaForCausalLM"))
    assert llama.features() == frozenset() and llama.layers[0].attention.scale is None
    assert describe_layers(_hf("Qwen2ForCausalLM")).features() == {"attention bias"}
    mistral = describe_layers(_hf("MistralForCausalLM", sliding_window=32))
    assert mistral.windows == (32,) and not any(layer.attention.rope.local for layer in mistral.layers)
    qwen2_moe = describe_layers(_hf("Qwen2MoeForCausalLM", **_experts(shared_expert_intermediate_size=64,
                                                                       mlp_only_layers=[0])))
    assert qwen2_moe.layers[0].mlp.kind == "dense" and qwen2_moe.layers[1].mlp.kind == "experts"
    shared = qwen2_moe.layers[1].mlp.experts
    assert shared is not None and shared.shared_size == 64 and shared.top_k == 2
    olmoe = describe_layers(_hf("OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2))
    assert {layer.attention.qk_norm for layer in olmoe.layers} == {"full"}
    one_head = describe_layers(_hf("OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2, num_attention_heads=1))
    assert one_head.layers[0].attention.qk_norm == "head"  # one head: the full width is the head
    capped = describe_layers(_hf("LlamaForCausalLM", final_logit_softcapping=30.0))
    assert capped.features() == {"soft-capped logits"} and capped.final_softcap == 30.0


@pytest.mark.parametrize(("features", "executor", "reason"), [
    ({"post-norms", "GeGLU"}, CPU_STEP, "Gemma layers"),
    ({"full-width q/k norms"}, CPU_STEP, "experts or full-width q/k norms"),
    ({"experts"}, CPU_STEP, "experts or full-width q/k norms"),
    ({"embedding scale"}, CPU_STEP, "soft-capped logits or scaled embeddings"),
    ({"full-width q/k norms", "soft-capped logits"}, NATIVE_STEP, "full-width q/k norms"),
    ({"soft-capped logits"}, NATIVE_STEP, "soft-capped logits"),
    ({"sliding window", "post-norms"}, GRAPH_STEP, "sliding-window layers"),
    ({"post-norms"}, GRAPH_STEP, "Gemma layers"),
    ({"soft-capped logits"}, GRAPH_STEP, "soft-capped logits"),  # the captured step has no soft cap
])
def test_each_executor_declines_a_feature_it_does_not_run_with_its_reason(features, executor, reason):
    assert not features - set(FEATURES), "features named in the table"
    for group, said in executors.DECLINED[executor]:
        if features & group:
            assert said == reason
            break
    else:
        pytest.fail(f"{executor} runs {features}")


def test_gemma3_is_declined_by_the_cpu_and_graph_steps_and_run_by_the_native_and_eager_ones():
    gemma = describe_layers(_hf("Gemma3ForCausalLM", head_dim=16))
    assert layer_declines(EAGER, gemma) is None and layer_declines(NATIVE_STEP, gemma) is None
    assert layer_declines(CPU_STEP, gemma) == "Gemma layers"
    assert layer_declines(GRAPH_STEP, gemma) == "sliding-window layers"
    assert executors.runs(EAGER) == frozenset(FEATURES) - {"output gate"}


def test_the_feature_table_in_the_docs_is_the_one_the_executors_read():
    assert executors.feature_table() in DETAILS.read_text(encoding="utf-8"), "regenerate it: executors.feature_table()"


def test_hybrid_attention_layers_are_described_with_their_rope_gate_and_scale():
    from tests.hybrid_fixtures import tiny_hybrid_config

    lfm2, qwen3_5, granite = (attention_spec(hybrid_config_from_hf(tiny_hybrid_config(arch).to_dict()))
                              for arch in ("lfm2", "qwen3_5", "granitemoehybrid"))
    assert lfm2.rotary_dim is None and lfm2.qk_norm == "head" and not lfm2.output_gate
    assert qwen3_5.output_gate and qwen3_5.rotary_dim is not None and qwen3_5.rotary_dim > 0
    assert granite.rotary_dim == 0 and granite.qk_norm == "none"  # Granite-4.0-H attends without positions
    assert {"partial or no rope", "output gate"} <= set(FEATURES)
