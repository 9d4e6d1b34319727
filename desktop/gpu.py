"""Whether this computer has an NVIDIA GPU, found cheaply and without torch (the desktop never imports it), and
the settings that only act on one: the Settings tab hides those on a machine without one.

The engine runs on CUDA only (no ROCm, no Apple GPU): a machine without an NVIDIA driver runs it on the CPU.
"""

from __future__ import annotations

import os
import shutil
import sys

# Settings that change nothing unless the engine runs on an NVIDIA GPU (engine/config.py's help texts, checked
# against the code that reads them):
# - no_cuda_graphs (--no-cuda-graphs): replays of captured CUDA graphs; a CPU model never captures any.
# - deterministic (--deterministic): "on CUDA"; a CPU model's kernels are batch-invariant whatever it says
#   (engine/model/graph_decode.configure: batch_invariant = deterministic or not on_cuda).
# - gpu_weights (--gpu-weights): the format of weights on a CUDA device.
# - devices (--devices): auto is cuda:0 when there is one, else cpu; without a GPU the CPU is the only device.
# - layer_split (--layer-split): splits layers across --devices; CPU stages (cpu,cpu) compute the same on the
#   same cores, one stage in effect.
# - device_draft (--device-draft): where the draft model runs; on a CPU-only machine only cpu, where the model is.
# Kept on a CPU-only machine, though their names speak of GPUs:
# - moe_experts / moe_cpu_layers (--moe-experts, --moe-cpu-layers): on the CPU they still choose 4-bit
#   experts beside float weights (--cpu-weights float --moe-experts cpu, docs/BENCHMARKS.md measures it).
# - dtype / kv_dtype: bfloat16 and float16 run on the CPU too.
GPU_ONLY_SETTINGS = ("no_cuda_graphs", "deterministic", "gpu_weights", "devices", "layer_split", "device_draft")


def nvidia_gpu_present(*, platform: str = sys.platform, root: str | None = None, path: str | None = None) -> bool:
    """True when an NVIDIA driver is installed: on Linux its /proc entry (or WSL's CUDA library), on Windows its
    nvml.dll in System32, or nvidia-smi on PATH. A few file checks, no process started.

    `root` is "/" (Linux) or %SystemRoot% (Windows) and `path` the PATH to search; tests pass others.
    """
    if platform == "darwin":
        return False  # no CUDA on macOS
    if platform == "win32":
        system_root = root if root is not None else os.environ.get("SYSTEMROOT", r"C:\Windows")
        if os.path.exists(os.path.join(system_root, "System32", "nvml.dll")):
            return True
    else:
        base = root if root is not None else "/"
        for parts in (("proc", "driver", "nvidia", "version"), ("usr", "lib", "wsl", "lib", "libcuda.so.1")):
            if os.path.exists(os.path.join(base, *parts)):
                return True
    return shutil.which("nvidia-smi", path=path) is not None
