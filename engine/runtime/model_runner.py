"""The model runner: one forward over a batch of chunks on the threads for its kind of step, the warm-up before
serving, and the decode mode (engine thread only)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from engine.kv import KVBuffers
from engine.runtime.memory import SlotMemory
from engine.runtime.threads import StepThreads

if TYPE_CHECKING:
    from engine.model.llama import SeqChunk
    from engine.runtime.protocols import Model

log = logging.getLogger("strata.engine")


class ModelRunner:
    """Runs the model over the slots' K/V and memory."""

    def __init__(self, model: Model, kv: KVBuffers, memory: SlotMemory, step_threads: StepThreads) -> None:
        self.model = model
        self.kv = kv
        self.memory = memory
        self.step_threads = step_threads

    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """One forward over `chunks` (a hybrid model also advances each slot's recurrent state), on the threads
        for its kind of step (engine/runtime/threads.py)."""
        decode = all(ch.tokens.numel() == 1 for ch in chunks)
        self.step_threads.before_step(decode)
        started = time.perf_counter()
        logits = self.model.forward_chunks(chunks, self.kv, *self.memory.forward_args())
        self.step_threads.after_step(decode, len(chunks), time.perf_counter() - started)
        return logits

    def configure_decode(self, n_slots: int, *, cuda_graphs: bool, deterministic: bool) -> None:
        """The decode mode from --no-cuda-graphs and --deterministic (engine.model.graph_decode.configure)."""
        from engine.model.graph_decode import configure

        log.info(configure(self.model, n_slots, cuda_graphs=cuda_graphs, deterministic=deterministic))

    def warm_up(self, ctx_size: int) -> None:
        """One short prefill and one decode step before serving, so the first request (often a conversation
        resumed after a restart) does not pay the kernels' one-time set-up; the slots it used are left empty."""
        from engine.model.llama import SeqChunk

        with torch.inference_mode():
            prompt = torch.zeros(min(8, ctx_size - 1), dtype=torch.int64)
            self.forward([SeqChunk(0, 0, prompt)])
            self.forward([SeqChunk(0, len(prompt), prompt[:1])])
            # Captured decode (GraphDecode): the graph of every batch size for short conversations now, not in
            # a request. The CPU decode steps (CpuDecode, NativeDecode) capture nothing.
            batches = self.model.warm_up_batches()
            for rows in batches:
                self.forward([SeqChunk(i, len(prompt), prompt[:1]) for i in range(rows)])
        torch.set_num_threads(self.step_threads.compute)  # this thread's count as the engine found it
        for i in range(max(batches, default=1)):
            self.kv.clear(i)
            self.memory.clear(i)
        self.build_rope_tables(ctx_size)

    def build_rope_tables(self, ctx_size: int) -> None:
        """The RoPE cos/sin rows of every position a slot can hold, on each stage, now. Grown on demand they were
        built by the first request past the warm-up's few positions, twice for a conversation resumed after a
        restart (at its length, then at double for its first decoded token), each time in fresh memory: about
        2,600 page faults in an LFM2-shaped model's first request at 2,051 tokens."""
        devices = list(dict.fromkeys(device for device, _, _ in self.model.stages))
        for table in self.model.rope_tables():
            for device in devices:
                table.get(ctx_size, device, self.model.dtype)
