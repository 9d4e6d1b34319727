"""The family registry (engine/model/families.py): every family once, with a reader that exists, and every
reader's names taken from it."""

import importlib

import pytest

from engine.model import families
from engine.model.config import ModelConfig
from engine.model.hybrid import gguf_loader
from engine.model.hybrid.loader import FAMILIES as HYBRID_READERS

BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 6, "intermediate_size": 128,
        "vocab_size": 100}
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def test_every_family_is_registered_once_with_a_reader_that_exists():
    seen: dict[str, str] = {}
    for f in families.FAMILIES:
        importlib.import_module(f.reader)
        for name in f.hf_architectures + f.gguf_architectures:
            assert seen.setdefault(name, f.name) == f.name, f"{name} is claimed by {seen[name]} and {f.name}"
    hybrids = {f.name for f in families.FAMILIES if f.kind == "hybrid"}
    assert hybrids == set(HYBRID_READERS)
    for name, kind in ((g, f.kind) for f in families.FAMILIES for g in f.gguf_architectures):
        assert gguf_loader.is_hybrid_gguf({"general.architecture": name}) == (kind == "hybrid"), name


@pytest.mark.parametrize("family", [f for f in families.FAMILIES if f.kind != "hybrid"], ids=lambda f: f.name)
def test_every_dense_and_expert_family_is_read_from_its_hf_names(family):
    extra = dict(EXPERTS) if family.kind == "moe" else {}
    if family.name == "qwen2_moe":
        extra["shared_expert_intermediate_size"] = 64
    if family.name == "deepseek_v3":  # DeepseekV3Config's defaults (8 groups, 4 kept) need more than 4 experts
        extra |= {"n_group": 1, "topk_group": 1}
    if family.name == "gemma4":  # global heads as wide as the sliding ones (wider ones are refused yet)
        extra["global_head_dim"] = 256
    for arch in family.hf_architectures:
        assert ModelConfig.from_hf({"architectures": [arch]} | BASE | extra).architecture == family.name
    for model_type in family.hf_model_types:
        assert ModelConfig.from_hf({"model_type": model_type} | BASE | extra).architecture == family.name
