"""The gated-DeltaNet families with experts (Qwen3-Next, Qwen3.5-MoE) beyond the per-family parity of
test_hybrid_models.py: where the expert blocks sit, their routed experts placed in host RAM as 4-bit groups by
`--moe-cpu-layers` (the layer's other weights untouched, a parked conversation still restored exactly), the
stage planner's estimate, and GGUF files llama.cpp's converter could not have written refused with the reason."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ModelLoadError
from engine.model import SeqChunk, int4, load_model
from engine.model.loader import read_model_config
from engine.model.planning import layer_bytes
from tests.hybrid_fixtures import one_thread, write_tiny_hybrid  # noqa: F401 (fixture)

needs_int4 = pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernels")
CPU = [(torch.device("cpu"), 0, 4)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid-moe")
    return {arch: write_tiny_hybrid(root, arch) for arch in ("qwen3_next", "qwen3_5_moe")}


def test_expert_blocks_sit_where_each_family_puts_them(folders):
    """Qwen3-Next: experts on every layer but those in mlp_only_layers (layer 2 here); Qwen3.5-MoE: everywhere."""
    for arch, want in (("qwen3_next", [True, True, False, True]), ("qwen3_5_moe", [True] * 4)):
        lm = load_model(folders[arch], CPU, torch.float32)
        assert [layer.moe is not None for layer in lm.model.layers] == want, arch
        assert [lm.config.is_moe_layer(i) for i in range(4)] == want
        moe = lm.config.moe
        assert (moe.n_experts, moe.top_k, moe.expert_size, moe.shared_expert_size) == (4, 2, 32, 48)
        assert moe.routing == "softmax_topk" and moe.norm_topk_prob
        assert lm.config.describe()["moe"]["dense_layers"] == ([2] if arch == "qwen3_next" else [])
    dense = read_model_config(write_tiny_hybrid(folders["qwen3_next"] + "-q35", "qwen3_5"))
    assert "moe" not in dense.describe()  # a dense hybrid's identity is what it was before experts existed


def _experts_on_int4_grid(folder: str) -> str:
    """The folder's routed experts rounded to a 4-bit grid per group of 32 (as a Q4_1 file's are), so 4-bit
    experts lose nothing and what differs from float is the kernel's bfloat16 activations."""
    import os

    from safetensors.torch import load_file, save_file

    from tests.model_fixtures import on_int4_grid

    file = os.path.join(folder, "model.safetensors")
    weights = {k: on_int4_grid(w) if ".mlp.experts." in k else w for k, w in load_file(file).items()}
    save_file(weights, file, metadata={"format": "pt"})
    return folder


@needs_int4
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_moe_cpu_layers_put_those_layers_routed_experts_in_host_ram_as_4_bit_groups(tmp_path, arch):
    from engine.model import moe_placement

    path = _experts_on_int4_grid(write_tiny_hybrid(tmp_path, arch))
    shape = read_model_config(path)
    placed_layers = moe_placement.cpu_expert_layers(shape, "gpu", 2)
    assert placed_layers == {0, 1}
    float_lm, split_lm = load_model(path, CPU, torch.float32), load_model(path, CPU, torch.float32,
                                                                            cpu_experts=placed_layers)
    for i, (a, b) in enumerate(zip(float_lm.model.layers, split_lm.model.layers, strict=True)):
        if i in placed_layers:
            assert all(isinstance(w, int4.Int4Weight) for w in (*b.moe.gate_up, *b.moe.down))
            assert isinstance(b.moe.shared_gate_up, torch.Tensor)  # the shared expert runs where the layer runs
        elif b.moe is not None:
            assert torch.equal(a.moe.gate_up, b.moe.gate_up) and torch.equal(a.moe.down, b.moe.down)
    assert moe_placement.describe(split_lm.model.layers)["experts"][:2] == ["0:cpu:int4", "1:cpu:int4"]
    every = moe_placement.cpu_expert_layers(shape, "cpu", 0)  # the planner weighs the largest layer
    assert layer_bytes(shape, torch.float32, 1, 256, every) < layer_bytes(shape, torch.float32, 1, 256)

    ids = torch.randint(3, shape.vocab_size, (120,), generator=torch.Generator().manual_seed(4))
    exact, ours = (lm.model.forward_chunks([SeqChunk(0, 0, ids)], *lm.model.new_buffers(1, 128), all_logits=True)[0]
                   for lm in (float_lm, split_lm))
    # bfloat16 activations move a row by ~1%; a token whose top-2 experts nearly tie may switch expert
    error = (ours - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert 0 < error.median().item() < 0.02, f"{arch}: median relative logit error {error.median():.3f}"
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean().item() >= 0.9


@needs_int4
def test_a_qwen3_next_conversation_with_experts_in_host_ram_parks_and_resumes_exactly(folders):
    from tools.conversation_cache_parity import run_scenario

    base = {"model": folders["qwen3_next"], "devices": "cpu", "ctx_size": 512, "cpu_weights": "float",
            "moe_cpu_layers": 2, "conversation_cache_storage": "disk", "conversation_cache_min_free_mib": 0,
            "prefill_chunk": 32, "conversation_cache_checkpoint_tokens": 64}
    outcome = run_scenario("basic", base, n_words=40, max_tokens=8)
    assert outcome.passed, outcome.detail


def test_gguf_expert_layers_without_a_shared_expert_or_with_sigmoid_gating_are_refused(tmp_path):
    from engine.model.gguf_header import read_gguf_header
    from engine.model.hybrid import gguf_qwen35
    from tests.hybrid_fixtures import write_tiny_hybrid_gguf

    path = write_tiny_hybrid_gguf(tmp_path, "qwen3_next")
    header = read_gguf_header(path)
    meta, names = header.metadata, {t.name for t in header.tensors}
    rows = read_model_config(path).vocab_size
    assert gguf_qwen35.config(meta, names, path, rows).moe.dense_layers == ()
    no_shared = {n for n in names if "shexp" not in n}
    with pytest.raises(ModelLoadError, match="qwen3next expert layers need a shared expert"):
        gguf_qwen35.config(meta, no_shared, path, rows)
    with pytest.raises(ModelLoadError, match="expert gating function 2 is not supported"):
        gguf_qwen35.config({**meta, "qwen3next.expert_gating_func": 2}, names, path, rows)
    # multi-token-prediction layers after the model's own are not part of it
    mtp = {**meta, "qwen3next.block_count": 5, "qwen3next.nextn_predict_layers": 1}
    assert gguf_qwen35.config(mtp, names, path, rows).n_layers == 4


def test_hf_configs_the_experts_cannot_describe_are_refused_with_the_reason(folders, tmp_path):
    import json
    import shutil

    for arch, change, message in (
        ("qwen3_5_moe", {"num_experts_per_tok": 8}, r"num_experts_per_tok \(8\) exceeds the number of experts \(4\)"),
        ("qwen3_next", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("qwen3_next", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ):
        folder = tmp_path / f"{arch}-{next(iter(change))}"
        shutil.copytree(folders[arch], folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(change)
        cfg = {k: v for k, v in cfg.items() if v is not None}
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match=message):
            read_model_config(str(folder))


# llama.cpp's converter wrapped for a tiny model: our test tokenizer is not one whose pre-tokenizer it knows, so
# that one lookup answers "default" (what the fixture GGUFs say); every tensor and key is the converter's own.
_CONVERT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
import conversion.base as base
for cls in vars(base).values():
    if isinstance(cls, type) and hasattr(cls, "get_vocab_base_pre"):
        cls.get_vocab_base_pre = lambda self, tokenizer: "default"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", "f32", "--no-mtp"]
convert_hf_to_gguf.main()
"""


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe", "qwen3_5"])
def test_a_gguf_written_by_llama_cpps_own_converter_gives_the_hf_logits(tmp_path, arch):
    """The fixture's GGUF writer imitates llama.cpp's converter; this runs the converter itself (its source tree
    in LLAMA_CPP_SRC, e.g. the b11434 sdist) on the tiny HF model and loads what it wrote (the dense Qwen3.5 too,
    whose GGUF loader the MoE families share)."""
    import os
    import subprocess
    import sys

    src = os.environ.get("LLAMA_CPP_SRC", "")
    if not os.path.isfile(os.path.join(src, "convert_hf_to_gguf.py")):
        pytest.skip("set LLAMA_CPP_SRC to a llama.cpp source tree to run its converter")
    folder = write_tiny_hybrid(tmp_path, arch, overrides={"mlp_only_layers": []} if arch == "qwen3_next" else None)
    out = str(tmp_path / f"{arch}.gguf")
    done = subprocess.run([sys.executable, "-c", _CONVERT, src, folder, out], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    ids = torch.randint(3, 300, (150,), generator=torch.Generator().manual_seed(2))
    logits = []
    for path in (out, folder):
        lm = load_model(path, CPU, torch.float32)
        logits.append(lm.model.forward_chunks([SeqChunk(0, 0, ids)], *lm.model.new_buffers(1, 256), all_logits=True)[0])
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-5
