"""Hybrid models (recurrent state + attention) against transformers on the same weights (float32, CPU):
one-shot and chunked prefill, greedy decode, batching of slots, checkpoints inside a prefill chunk."""

from __future__ import annotations

import pytest
import torch

from engine.model import SeqChunk, load_model
from engine.model.hybrid import HybridCausalLM
from tests.hybrid_fixtures import HYBRID_ARCHS, one_thread, write_tiny_hybrid  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

ATOL = 1e-4
N_PROMPT = 200
N_DECODE = 10


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-hybrid")
    return {arch: write_tiny_hybrid(root, arch) for arch in HYBRID_ARCHS}


@pytest.fixture(scope="module")
def reference(hybrid_models) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per arch: (prompt + greedy continuation from transformers' generate, transformers' logits over it)."""
    out = {}
    for arch, path in hybrid_models.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompt = _prompt(model.config.vocab_size)
        with torch.no_grad():
            seq = model.generate(
                prompt[None], max_new_tokens=N_DECODE, min_new_tokens=N_DECODE, do_sample=False, pad_token_id=0
            )[0]
            logits = model(seq[None]).logits[0]
        out[arch] = (seq, logits)
    return out


def _prompt(vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (N_PROMPT,), generator=g)


def _load(path: str, stages=None):
    lm = load_model(path, stages or [(torch.device("cpu"), 0, 4)], torch.float32)
    assert isinstance(lm.model, HybridCausalLM)
    return lm


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_one_shot_prefill_matches_transformers(hybrid_models, reference, arch):
    lm = _load(hybrid_models[arch])
    seq, ref = reference[arch]
    kv, state = lm.model.new_buffers(2, 256)
    ours = lm.model.forward_chunks([SeqChunk(1, 0, seq)], kv, state, all_logits=True)[0]
    diff = _diff(ours, ref)
    assert diff <= ATOL, f"{arch}: max |logit diff| {diff:.3g} > {ATOL} (logit scale {ref.abs().max():.3g})"
    assert ref.abs().max() > 1.0, "logits too small for the comparison to mean anything"
    assert state.positions[1] == len(seq)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("chunk", [1, 7, 64, 200])
def test_chunked_prefill_then_greedy_decode_match_transformers(hybrid_models, reference, arch, chunk):
    lm = _load(hybrid_models[arch])
    seq, ref = reference[arch]
    kv, state = lm.model.new_buffers(3, 256)
    for a in range(0, N_PROMPT, chunk):
        b = min(a + chunk, N_PROMPT)
        got = lm.model.forward_chunks([SeqChunk(2, a, seq[a:b])], kv, state, all_logits=True)[0]
        diff = _diff(got, ref[a:b])
        assert diff <= ATOL, f"{arch}: prefill chunk [{a},{b}) differs from transformers by {diff:.3g}"
    logits = ref[N_PROMPT - 1]
    token = int(got[-1].argmax())
    for pos in range(N_PROMPT, N_PROMPT + N_DECODE):
        assert token == int(seq[pos]), f"{arch}: greedy token at {pos} is {token}, transformers chose {int(seq[pos])}"
        logits = lm.model.forward_chunks([SeqChunk(2, pos, torch.tensor([token]))], kv, state)[0]
        if pos + 1 < len(seq):
            diff = _diff(logits, ref[pos])
            assert diff <= ATOL, f"{arch}: decode at position {pos} differs from transformers by {diff:.3g}"
        token = int(logits.argmax())


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_two_slots_batched_give_what_each_gives_alone(hybrid_models, arch):
    lm = _load(hybrid_models[arch])
    vocab = lm.config.vocab_size
    prompts = {0: _prompt(vocab, seed=2)[:90], 2: _prompt(vocab, seed=3)[:130]}

    def run(slots: list[int]) -> dict[int, list[torch.Tensor]]:
        kv, state = lm.model.new_buffers(3, 256)
        out = {s: [] for s in slots}
        logits = lm.model.forward_chunks([SeqChunk(s, 0, prompts[s]) for s in slots], kv, state)
        tokens = {s: int(logits[i].argmax()) for i, s in enumerate(slots)}
        for s, row in zip(slots, logits, strict=True):
            out[s].append(row)
        for step in range(5):
            chunks = [SeqChunk(s, len(prompts[s]) + step, torch.tensor([tokens[s]])) for s in slots]
            logits = lm.model.forward_chunks(chunks, kv, state)
            for i, s in enumerate(slots):
                out[s].append(logits[i])
                tokens[s] = int(logits[i].argmax())
        return out

    together = run([0, 2])
    for s in (0, 2):
        alone = run([s])[s]
        for step, (a, b) in enumerate(zip(together[s], alone, strict=True)):
            assert torch.equal(a, b), f"{arch}: slot {s} step {step} depends on its batch ({_diff(a, b):.3g})"


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("at", [77, 128])
def test_checkpoint_inside_a_prefill_chunk_resumes_like_the_full_prefill(hybrid_models, reference, arch, at):
    """A snapshot taken at `at` inside one 200-token chunk (on a scan block edge or between edges), restored
    into another slot, continues the prompt from there with transformers' logits; the K/V rows below `at`
    are copied like the cache would."""
    lm = _load(hybrid_models[arch])
    seq, ref = reference[arch]
    kv, state = lm.model.new_buffers(2, 256)
    state.request_checkpoints(0, [at, 150, N_PROMPT])
    lm.model.forward_chunks([SeqChunk(0, 0, seq[:N_PROMPT])], kv, state)
    snaps = state.take_checkpoints(0)
    assert sorted(snaps) == [at, 150, N_PROMPT] and state.take_checkpoints(0) == {}
    final = state.read(0)
    assert all(torch.equal(a, b) for a, b in zip(snaps[N_PROMPT].tensors, final.tensors, strict=True))
    assert snaps[at].nbytes == lm.model.state_layout().bytes_per_slot
    assert not all(torch.equal(a, b) for a, b in zip(snaps[at].tensors, final.tensors, strict=True))

    kv.write(1, 0, kv.read(0, 0, at))
    state.write(1, snaps[at])
    got = lm.model.forward_chunks([SeqChunk(1, at, seq[at:N_PROMPT])], kv, state, all_logits=True)[0]
    diff = _diff(got, ref[at:N_PROMPT])
    assert diff <= ATOL, f"{arch}: resumed from the checkpoint at {at}, logits differ from transformers by {diff:.3g}"


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_a_chunk_that_skips_the_state_position_is_refused(hybrid_models, arch):
    lm = _load(hybrid_models[arch])
    kv, state = lm.model.new_buffers(1, 64)
    lm.model.forward_chunks([SeqChunk(0, 0, torch.arange(3, 13))], kv, state)
    with pytest.raises(AssertionError, match="recurrent state is at 10"):
        lm.model.forward_chunks([SeqChunk(0, 12, torch.arange(3, 6))], kv, state)
    state.clear(0)
    assert state.positions[0] == 0 and all(not t.any() for t in state.read(0).tensors)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_layer_split_over_two_stages_equals_one_stage(hybrid_models, arch):
    """Each layer's K/V and recurrent state live on its stage; parked state is split-independent."""
    cpu = torch.device("cpu")
    one = _load(hybrid_models[arch])
    two = _load(hybrid_models[arch], [(cpu, 0, 1), (cpu, 1, 4)])
    # stage one holds layer 0: no K/V at all where it is recurrent only (every family here but Falcon-H1's)
    attn = two.config.attention_layers
    assert two.model.kv_stages() == [(cpu, 0, int(0 in attn)), (cpu, int(0 in attn), len(attn))]
    ids = _prompt(one.config.vocab_size)[:120]
    (kv1, st1), (kv2, st2) = one.model.new_buffers(1, 128), two.model.new_buffers(1, 128)
    a = one.model.forward_chunks([SeqChunk(0, 0, ids)], kv1, st1)
    b = two.model.forward_chunks([SeqChunk(0, 0, ids)], kv2, st2)
    assert torch.equal(a, b), f"{arch}: max diff {_diff(a, b):.3g}"
    assert torch.equal(kv1.read(0, 0, 120), kv2.read(0, 0, 120))
    s1, s2 = st1.read(0), st2.read(0)
    assert s1.position == s2.position == 120
    assert all(torch.equal(x, y) for x, y in zip(s1.tensors, s2.tensors, strict=True))
    # A state parked under the split restores on one stage and continues identically.
    st1.write(0, s2)
    token = torch.tensor([int(a[0].argmax())])
    c = one.model.forward_chunks([SeqChunk(0, 120, token)], kv1, st1)
    d = two.model.forward_chunks([SeqChunk(0, 120, token)], kv2, st2)
    assert torch.equal(c, d)


def test_state_layout_covers_only_the_recurrent_layers(hybrid_models):
    lm = _load(hybrid_models["qwen3_5"])
    c = lm.config
    layout = lm.model.state_layout()
    assert [(p.layer, p.name) for p in layout.parts] == [(0, "conv"), (0, "ssm"), (2, "conv"), (2, "ssm")]
    assert layout.parts[1].shape == (c.linear_v_heads, c.linear_k_dim, c.linear_v_dim)
    assert layout.parts[0].shape == (c.conv_kernel - 1, c.conv_channels)
    assert lm.model.kv_layout().n_layers == 2
    assert layout.describe()["dtype"] == "float32"


def test_nemotron_h_unknown_blocks_and_activations_are_refused_clearly(tmp_path):
    import json

    from engine.errors import ModelLoadError
    from engine.model.loader import read_model_config

    base = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 64,
            "num_attention_heads": 4, "vocab_size": 300, "intermediate_size": 96}
    for extra, message in (({"layers_block_type": ["mlp", "conv"]}, r"unknown Nemotron-H block type\(s\) \['conv'\]"),
                           ({"hybrid_override_pattern": "M*-", "mlp_hidden_act": "gelu"}, "only relu2")):
        (tmp_path / "config.json").write_text(json.dumps({**base, **extra}))
        with pytest.raises(ModelLoadError, match=message):
            read_model_config(str(tmp_path))


def test_nemotron_h_pattern_string_gives_the_layer_kinds():
    from engine.model.hybrid.nemotron_h import layer_kinds

    assert layer_kinds({"hybrid_override_pattern": "M-M*-"}) == ("mamba2", "mlp", "mamba2", "attention", "mlp")
    assert layer_kinds({"hybrid_override_pattern": "ME*"}) == ("mamba2", "mlp", "attention")  # experts: an MLP block
    assert layer_kinds({"layers_block_type": ["linear_attention", "mlp"]}) == ("mamba2", "mlp")


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_gguf_loads_the_same_model(tmp_path, arch):
    """An unquantised GGUF with llama.cpp's names, keys and tensor rewrites gives the logits of its HF folder;
    a Q8_0 one gives those of the folder's weights rounded through Q8_0."""
    from engine.model.hybrid.gguf_qwen35 import untile_v_heads
    from engine.model.loader import read_model_config
    from tests.hybrid_fixtures import _tile_v_heads, write_tiny_hybrid_gguf

    path = write_tiny_hybrid_gguf(tmp_path, arch)
    from_gguf, from_folder = _load(path), _load(str(tmp_path / f"tiny-{arch}"))
    assert from_gguf.config.layer_kinds == from_folder.config.layer_kinds
    assert read_model_config(path) == from_gguf.config
    ids = _prompt(from_folder.config.vocab_size)[:100]
    assert from_gguf.tokenizer.encode("Hello, world!") == from_folder.tokenizer.encode("Hello, world!")
    a, b = (lm.model.forward_chunks([SeqChunk(0, 0, ids)], *lm.model.new_buffers(1, 128), all_logits=True)[0]
            for lm in (from_gguf, from_folder))
    # Falcon-H1's converter folds the multipliers into the weights (other roundings than the folder's load)
    tol = ATOL if arch == "falcon_h1" else 1e-5
    assert _diff(a, b) <= tol, f"{arch}: GGUF and HF folder differ by {_diff(a, b):.3g}"
    # Q8_0: the same as the float file's model with every quantised matrix rounded through Q8_0 in memory (the
    # file's weights, not the folder's: Falcon-H1's converter folds its multipliers in before quantising).
    import gguf

    quantized = _load(write_tiny_hybrid_gguf(tmp_path / "q8", arch, quantize=True))
    for name, buf in from_gguf.model.named_buffers():
        if buf.dim() == 2 and buf.shape[1] % 32 == 0 and not name.endswith("router"):  # routers stay float
            w = buf.numpy()
            # llama.cpp tiles the value heads of Qwen3.5's DeltaNet output columns: its Q8_0 groups hold those
            tiled = arch in ("qwen3_5", "qwen3_5_moe") and name.endswith("mixer.w_out")
            c = from_gguf.config
            heads = (c.linear_k_heads, c.linear_v_heads // c.linear_k_heads, c.linear_v_dim) if tiled else ()
            w = _tile_v_heads(w, 1, *heads) if tiled else w
            q8 = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                                                         gguf.GGMLQuantizationType.Q8_0))
            buf.copy_(untile_v_heads(q8, 1, *heads) if tiled else q8)
    c, d = (lm.model.forward_chunks([SeqChunk(0, 0, ids)], *lm.model.new_buffers(1, 128), all_logits=True)[0]
            for lm in (quantized, from_gguf))
    assert _diff(c, d) <= ATOL, f"{arch}: the Q8_0 GGUF differs from Q8_0-rounded weights by {_diff(c, d):.3g}"
    assert _diff(c, b) > 1e-3, "the Q8_0 file was not quantised"


@pytest.mark.parametrize("gguf_arch", ["mamba2"])
def test_hybrid_gguf_architectures_not_supported_yet_are_refused_clearly(tmp_path, gguf_arch):
    import gguf

    from engine.errors import ModelLoadError

    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=f"'{gguf_arch}' .* is not supported from GGUF yet; load its Hugging Face"):
        load_model(str(path), [(torch.device("cpu"), 0, 1)], torch.float32)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_bfloat16_weights_keep_a_float32_state_and_track_float32(hybrid_models, arch):
    cpu = [(torch.device("cpu"), 0, 4)]
    ids = _prompt(300)[:70]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        lm = load_model(hybrid_models[arch], cpu, dtype)
        kv, state = lm.model.new_buffers(2, 128)
        assert kv.layout.dtype == dtype and state.layout.dtype == torch.float32
        a = lm.model.forward_chunks([SeqChunk(0, 0, ids[:64])], kv, state)
        b = lm.model.forward_chunks([SeqChunk(0, 64, ids[64:65]), SeqChunk(1, 0, ids[:5])], kv, state)
        out[dtype] = torch.cat((a, b))
    ref, low = out[torch.float32], out[torch.bfloat16]
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    rows = (low - ref).abs().amax(-1)
    # With experts, bfloat16 rounding may route a token whose top-k is a near tie to another expert (a discrete
    # change of that row); the typical row must still track float32. Transformers' own bfloat16 forward of the
    # tiny Granite MoE drifts 18% of the logit scale from its float32 one over these tokens.
    experts = lm.config.moe is not None or lm.config.nemotron_experts is not None
    drift = rows.median().item() if experts else rows.max().item()
    bound = 0.2 if arch == "granitemoehybrid_moe" else 0.1
    assert drift < bound * ref.abs().max().item(), f"{arch}: bfloat16 drifts {drift:.3g} from float32"


def test_a_hybrid_layer_is_planned_with_its_weights_kv_and_recurrent_state(hybrid_models):
    """The stage planner's estimate covers the weights, an attention layer's K/V for every slot and context
    token, and a recurrent layer's state per slot."""
    from engine.model.loader import read_model_config
    from engine.model.planning import layer_bytes

    for arch in HYBRID_ARCHS:
        shape = read_model_config(hybrid_models[arch])
        one = layer_bytes(shape, torch.float32, 1, 256)
        kv_rows = 2 * shape.n_kv_heads * shape.head_dim * 4
        assert one >= 3 * shape.hidden_size * shape.intermediate_size * 4
        long = layer_bytes(shape, torch.float32, 1, 8192)  # the attention layer is the largest from here on
        assert layer_bytes(shape, torch.float32, 1, 16384) - long == 8192 * kv_rows
        assert layer_bytes(shape, torch.float32, 3, 256) > layer_bytes(shape, torch.float32, 2, 256)


@pytest.mark.parametrize("before_gate", [True, False])
def test_falcon_h1_normalised_mamba_output_matches_transformers(tmp_path, before_gate):
    """Falcon-H1 with `mamba_rms_norm`: the Mamba-2 output normalised per group before or after the gate."""
    from tests import hybrid_fixtures

    config = hybrid_fixtures.tiny_hybrid_config("falcon_h1")
    config.mamba_rms_norm, config.mamba_norm_before_gate = True, before_gate
    folder = tmp_path / "falcon"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    hybrid_fixtures.write_tokenizer_files(folder)
    ids = _prompt(config.vocab_size)
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    lm = _load(str(folder))
    assert lm.config.mamba_norm == ("norm_then_gate" if before_gate else "gated")
    ours = lm.model.forward_chunks([SeqChunk(0, 0, ids)], *lm.model.new_buffers(1, 256), all_logits=True)[0]
    assert _diff(ours, ref) <= ATOL, f"max |logit diff| {_diff(ours, ref):.3g}"
