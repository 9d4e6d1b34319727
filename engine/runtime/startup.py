"""Engine start-up: the effective weights format, the cache and its identity, the warm-up step."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from engine import __version__
from engine.config import EngineConfig
from engine.model import moe_placement
from engine.runtime.state import EngineState

if TYPE_CHECKING:
    from engine.cache.api import CacheAPI
    from engine.cache.identity import CacheIdentity

log = logging.getLogger("strata.engine")


class Startup(EngineState):
    """What the engine builds before it serves (and again for the cache when its settings change)."""

    def _warm_up(self) -> None:
        """One short prefill and one decode step before serving, so the first request (often a conversation
        resumed after a restart) does not pay the kernels' one-time set-up."""
        from engine.model.llama import SeqChunk

        with torch.inference_mode():
            prompt = torch.zeros(min(8, self.ctx_size - 1), dtype=torch.int64)
            self._forward([SeqChunk(0, 0, prompt)])
            self._forward([SeqChunk(0, len(prompt), prompt[:1])])
            # Captured decode (GraphDecode): the graph of every batch size for short conversations now, not in
            # a request. The CPU decode steps (CpuDecode, NativeDecode) capture nothing.
            batches = getattr(getattr(self.model, "graphs", None), "batches", [])
            for rows in batches:
                self._forward([SeqChunk(i, len(prompt), prompt[:1]) for i in range(rows)])
        torch.set_num_threads(self.step_threads.compute)  # this thread's count as the engine found it
        for i in range(max(batches, default=1)):
            self.kv.clear(i)
            self.memory.clear(i)
        self._build_rope_tables()

    def _build_rope_tables(self) -> None:
        """The RoPE cos/sin rows of every position a slot can hold, on each stage, now. Grown on demand they were
        built by the first request past the warm-up's few positions, twice for a conversation resumed after a
        restart (at its length, then at double for its first decoded token), each time in fresh memory: about
        2,600 page faults in an LFM2-shaped model's first request at 2,051 tokens."""
        devices = list(dict.fromkeys(device for device, _, _ in self.model.stages))
        for name in ("rotary", "rotary_local"):
            table = getattr(self.model, name, None)
            if table is not None:
                for device in devices:
                    table.get(self.ctx_size, device, self.model.dtype)

    def _forward(self, chunks: list) -> torch.Tensor:
        """One forward over `chunks` (a hybrid model also advances each slot's recurrent state), on the threads
        for its kind of step (engine/runtime/threads.py)."""
        decode = all(ch.tokens.numel() == 1 for ch in chunks)
        self.step_threads.before_step(decode)
        started = time.perf_counter()
        logits = self.model.forward_chunks(chunks, self.kv, *self.memory.forward_args())
        self.step_threads.after_step(decode, len(chunks), time.perf_counter() - started)
        return logits

    def _configure_decode(self) -> None:
        """The decode mode from --no-cuda-graphs and --deterministic (engine.model.graph_decode.configure)."""
        from engine.model.graph_decode import configure

        log.info(configure(self.model, self.n_slots, cuda_graphs=not self.config.no_cuda_graphs,
                           deterministic=self.config.deterministic))

    def _make_cache(self, config: EngineConfig) -> CacheAPI | None:
        off = config.conversation_cache_storage == "ram" and config.conversation_cache_mib == 0
        if off:
            log.info("conversation cache off (--conversation-cache-mib 0)")
            return None
        from engine.cache import CacheSettings, ConversationCache

        return ConversationCache(CacheSettings.from_engine_config(config), self._identity(),
                                 engine_version=__version__)

    def _identity(self) -> CacheIdentity:
        """What parked K/V and session files must match to be restored here (block size is fixed at start)."""
        if self.cache_identity is None:
            from engine.cache import CacheIdentity
            from engine.model.kquant_weight import KQuantWeight
            from engine.model.native_decode import NativeDecode
            from engine.model.q8_output import Q8Output
            from engine.model.q8_weight import Q8Weight

            kernel = self._int4_kernel_name
            self.cache_identity = CacheIdentity(
                model={
                    **self.loaded.config.describe(),
                    "weights": self.loaded.fingerprint,
                    "weights_format": self.weights_format,  # int4 weights give other K/V than float ones
                    # and the two 4-bit kernels other K/V than each other (engine/model/int4.py)
                    **({"int4_kernel": kernel} if kernel else {}),
                    # an output matrix read from the file's Q8_0 blocks rather than 4-bit groups
                    **({"output": "Q8_0"} if isinstance(self.model.lm_head, Q8Output) else {}),
                    # projections kept as 8-bit rows because the file holds them with more than 4 bits
                    **({"eight_bit_weights": eight} if (eight := sum(
                        isinstance(getattr(layer, name, None), Q8Weight) for layer in self.model.layers
                        for name in ("wqkv", "wo", "w_gate_up", "w_down"))) else {}),
                    # projections multiplied in the file's own K-quant rows rather than converted (kquant_weight.py)
                    **({"kquant_weights": n} if (n := sum(
                        isinstance(getattr(layer, name, None), KQuantWeight) for layer in self.model.layers
                        for name in ("wqkv", "wo", "w_gate_up", "w_down"))) else {}),
                    # decoded tokens' K/V from step.c's arithmetic rather than PyTorch's
                    **({"decode_step": "native"} if isinstance(getattr(self.model, "graphs", None), NativeDecode) else {}),
                    "tokenizer": self.tokenizer.fingerprint,
                    **moe_placement.describe(self.model.layers),  # experts' device and format (MoE models)
                },
                layout=self.layout,
                block_tokens=self.config.conversation_cache_block_tokens,
                # a hybrid model's recurrent state (parked beside the attention K/V), a sliding-window one's window
                **self.memory.identity(),
            )
        return self.cache_identity

    def int4_kernel(self) -> str:
        """The 4-bit CPU kernel this engine's weights go through ("blocks" or "aten", engine/model/int4.py), or ""
        when none do: int4 weights on the CPU, or experts kept in host RAM (always 4-bit)."""
        from engine.model import int4

        on_cpu = all(torch.device(d).type == "cpu" for d, _, _ in self.model.stages)
        experts = moe_placement.describe(self.model.layers).get("experts", ())
        if (self.weights_format == "int4" and on_cpu) or any(e.endswith(":cpu:int4") for e in experts):
            return int4.kernel() or ""
        return ""

    def _session_identity(self) -> CacheIdentity:
        """What a session file must match: the cache identity, but every layer's K/V (a slot file holds all)."""
        import dataclasses

        identity = self._identity()
        return dataclasses.replace(identity, window=None, local_layers=()) if identity.local_layers else identity


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


def _gpu_weights_format(choice: str, dtype: torch.dtype, stages: list[tuple[torch.device, int, int]]) -> str:
    """The effective --gpu-weights ("bf16" or "int4"), checked before the load (ValueError when int4 cannot apply)."""
    from engine.model import gpu_weights

    return gpu_weights.resolve(choice, dtype, all(torch.device(d).type == "cuda" for d, _, _ in stages))


def _quantize_gpu_weights(loaded) -> None:
    """--gpu-weights int4 on a loaded CUDA model: its projection and output weights become 4-bit groups."""
    from engine.model import gpu_weights

    before, after = gpu_weights.quantize_model(loaded.model)
    log.info("--gpu-weights int4: %.0f MiB of projection weights as %.0f MiB of 4-bit groups", before / 2**20,
             after / 2**20)


def _check_float16(dtype: torch.dtype, stages: list[tuple[torch.device, int, int]]) -> None:
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


def _pack_float16(loaded) -> None:
    """--cpu-weights float16 on a loaded CPU model: its projections and output matrix packed as float16."""
    from engine.model import float16

    before, after = float16.pack_model(loaded.model)
    log.info("--cpu-weights float16: %.0f MiB of projection weights as %.0f MiB of packed float16", before / 2**20,
             after / 2**20)


def _check_int4(dtype: torch.dtype, stages: list[tuple[torch.device, int, int]]) -> None:
    """ValueError when `--cpu-weights int4` cannot apply."""
    from engine.model import int4

    if any(torch.device(d).type != "cpu" for d, _, _ in stages):
        raise ValueError("--cpu-weights int4: only for models on the CPU; use --cpu-weights float with --devices cuda")
    if dtype != torch.float32:
        raise ValueError("--cpu-weights int4: needs --dtype float32 (or auto) on the CPU")
    if not int4.available():
        raise ValueError(f"--cpu-weights int4: this PyTorch ({torch.__version__}) has no CPU int4 kernels")
