"""The next-token (MTP) layer of tiny Qwen3-Next / Qwen3.5 checkpoints (tests/hybrid_fixtures.py): written as the
released folders hold it, and renamed as llama.cpp's converter names it in a GGUF."""

from __future__ import annotations

from pathlib import Path

# llama.cpp's converter: a Qwen `mtp.*` tensor -> its name after "model.layers.<n_layers>." (then `blk.<n>.nextn.*`)
MTP_AS_LAYER = {"mtp.fc.weight": "eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
                "mtp.pre_fc_norm_hidden.weight": "hnorm.weight", "mtp.norm.weight": "shared_head_norm.weight"}


def add_mtp(path: Path, seed: int) -> None:
    """Random `mtp.*` tensors into a Qwen3-Next / Qwen3.5 checkpoint (transformers drops them, so writes none): a
    decoder layer with the names and shapes of the model's attention layer 1 (its MLP kind too), the [embedding;
    hidden] projection `fc` and the three zero-centred norms."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(seed + 1)

    def norm(size: int) -> torch.Tensor:
        return torch.rand(size, generator=g) - 0.5  # stored as w - 1

    layer = "model.layers.1."  # full attention (tiny_hybrid_config)
    added = {
        "mtp.layers.0." + name[len(layer):]: norm(t.shape[0]) if "norm" in name else 0.08 * torch.randn(
            t.shape, generator=g)
        for name, t in tensors.items() if name.startswith(layer)
    }
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    added["mtp.fc.weight"] = 0.08 * torch.randn(hidden, 2 * hidden, generator=g)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        added[f"mtp.{name}.weight"] = norm(hidden)
    save_file({**tensors, **added}, str(path), metadata={"format": "pt"})


def mtp_as_converted(weights: dict, n_layers: int) -> dict[str, str]:
    """Rename `weights`' `mtp.*` tensors in place as the converter does (a layer after the model's `n_layers`);
    returns the GGUF names of the layer's own tensors (`blk.<n>.nextn.*`), which gguf's name map lacks for these
    architectures, by their new names."""
    nextn = {}
    for name in [n for n in weights if n.startswith("mtp.")]:
        rest = name.removeprefix("mtp.layers.0.")
        own = MTP_AS_LAYER.get(rest)
        weights[f"model.layers.{n_layers}.{own or rest}"] = weights.pop(name)
        if own:
            nextn[f"model.layers.{n_layers}.{own}"] = f"blk.{n_layers}.nextn.{own.removesuffix('.weight')}.weight"
    return nextn
