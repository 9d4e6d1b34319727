"""Engine start-up: the effective weights format (--cpu-weights, --gpu-weights), checked before the load, and
what it does to the loaded weights."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("strata.engine")


def choose_weights_format(choice: str, dtype: torch.dtype, stages: list[tuple[torch.device, int, int]]) -> str:
    """The effective --cpu-weights. auto, for a float32 model on the CPU: int4 where this PyTorch's 4-bit kernel
    is vectorised on this CPU (int4.kernel_slowdown, timed once), else float16 where FBGEMM is there (PyTorch for
    Windows has none: engine/model/float16.py), else float; anywhere else float. An explicit int4 on a scalar kernel is
    kept, with a warning."""
    from engine.model import int4

    on_cpu = all(torch.device(d).type == "cpu" for d, _, _ in stages)
    if not (on_cpu and dtype == torch.float32):
        return "float" if choice == "auto" else choice  # an explicit choice is checked (refused) by the caller
    if choice in ("float", "float16"):
        return choice
    if not int4.available():
        return _without_int4() if choice == "auto" else choice
    slowdown = int4.kernel_slowdown()
    if slowdown <= int4.SLOWER_LIMIT:
        log.info("4-bit CPU kernel: %s, %.2fx float32's time on weights in cache", int4.describe_kernel(), slowdown)
        return "int4"
    why = (f"this PyTorch's 4-bit CPU kernel runs {slowdown:.0f}x slower than float32 here (a scalar fallback: "
           f"no vectorised kernel for this CPU, or a build such as PyTorch for Windows that leaves it out)")
    if int4.kernel() == "blocks":  # the native kernels' generic build: a CPU without AVX2 (engine/model/kernels)
        why = f"the 4-bit CPU kernel runs {slowdown:.0f}x slower than float32 here: {int4.describe_kernel()}"
    if choice == "int4":
        log.warning("--cpu-weights int4: %s; --cpu-weights auto decodes faster", why)
        return "int4"
    fallback = _without_int4()
    log.warning("--cpu-weights auto: %s weights, as %s", "float16 (FBGEMM)" if fallback == "float16" else "float32",
                why)
    return fallback


def _without_int4() -> str:
    """auto's weights where 4-bit groups are not worth it; asked only then (FBGEMM's check packs a matrix)."""
    from engine.model import float16

    return "float16" if float16.available() else "float"


def gpu_weights_format(choice: str, dtype: torch.dtype, stages: list[tuple[torch.device, int, int]]) -> str:
    """The effective --gpu-weights ("bf16" or "int4"), checked before the load (ValueError when int4 cannot apply)."""
    from engine.model import gpu_weights

    return gpu_weights.resolve(choice, dtype, all(torch.device(d).type == "cuda" for d, _, _ in stages))


def quantize_gpu_weights(loaded) -> None:
    """--gpu-weights int4 on a loaded CUDA model: its projection and output weights become 4-bit groups."""
    from engine.model import gpu_weights

    before, after = gpu_weights.quantize_model(loaded.model)
    log.info("--gpu-weights int4: %.0f MiB of projection weights as %.0f MiB of 4-bit groups", before / 2**20,
             after / 2**20)


def check_float16(dtype: torch.dtype, stages: list[tuple[torch.device, int, int]]) -> None:
    """ValueError when `--cpu-weights float16` cannot apply."""
    from engine.model import float16

    if any(torch.device(d).type != "cpu" for d, _, _ in stages):
        raise ValueError("--cpu-weights float16: only for models on the CPU; use --cpu-weights float with --devices "
                         "cuda")
    if dtype != torch.float32:
        raise ValueError("--cpu-weights float16: needs --dtype float32 (or auto) on the CPU")
    if not float16.available():
        raise ValueError(f"--cpu-weights float16: this PyTorch ({torch.__version__}) has no FBGEMM fp16 linear (x86 "
                         "builds have it); use --cpu-weights auto")


def pack_float16(loaded) -> None:
    """--cpu-weights float16 on a loaded CPU model: its projections and output matrix packed as float16."""
    from engine.model import float16

    before, after = float16.pack_model(loaded.model)
    log.info("--cpu-weights float16: %.0f MiB of projection weights as %.0f MiB of packed float16", before / 2**20,
             after / 2**20)


def check_int4(dtype: torch.dtype, stages: list[tuple[torch.device, int, int]]) -> None:
    """ValueError when `--cpu-weights int4` cannot apply."""
    from engine.model import int4

    if any(torch.device(d).type != "cpu" for d, _, _ in stages):
        raise ValueError("--cpu-weights int4: only for models on the CPU; use --cpu-weights float with --devices cuda")
    if dtype != torch.float32:
        raise ValueError("--cpu-weights int4: needs --dtype float32 (or auto) on the CPU")
    if not int4.available():
        raise ValueError(f"--cpu-weights int4: this PyTorch ({torch.__version__}) has no CPU int4 kernels")
