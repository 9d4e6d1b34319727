"""What the Mamba-2 hybrids' GGUF files share (granitehybrid, nemotron_h, falcon-h1): metadata lookups and the
Mamba-2 shape from llama.cpp's `ssm.*` keys (time_step_rank = heads, inner_size = heads x head dim)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.errors import ModelLoadError


def metadata_key(meta: dict, arch: str, path: str) -> Callable[..., Any]:
    """key(name, default=None): `<arch>.<name>`, its default when absent, or a ModelLoadError naming it."""

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata {arch}.{name} is missing")
        return value

    return key


def mamba_fields(key: Callable[..., Any], tensor_names: set[str], path: str) -> dict[str, Any]:
    """HybridConfig's Mamba-2 fields from the `ssm.*` keys and the conv bias tensors."""
    heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    if heads <= 0 or inner % heads:
        raise ModelLoadError(f"{path}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {heads} (heads)")
    return dict(
        conv_kernel=int(key("ssm.conv_kernel")), conv_bias=any(n.endswith(".ssm_conv1d.bias") for n in tensor_names),
        mamba_heads=heads, mamba_head_dim=inner // heads, mamba_groups=int(key("ssm.group_count")),
        mamba_state_dim=int(key("ssm.state_size")),
    )
