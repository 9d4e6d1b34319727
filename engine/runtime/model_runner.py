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
    from engine.model.graph_verify import VerifyRows
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
        self.verify: VerifyRows | None = None  # a CUDA model's verify steps, once checked (verify_declines)

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

    def verify_declines(self, method: str, rows_per_slot: int) -> str:
        """'' when a step computes a slot's several rows (its token and `rows_per_slot` - 1 drafts) as it computes
        them one per step, bit for bit, else why not. The CPU kernels are batch-invariant by construction; a CUDA
        model verifies through its captured decode step once a check at start finds it row-invariant
        (engine/model/graph_verify.py)."""
        from engine.model import executors, graph_verify
        from engine.model.graph_decode import GraphDecode
        from engine.model.llama import CausalLM

        model = self.model
        if all(torch.device(d).type == "cpu" for d, _, _ in model.stages):
            return ""
        if method == "mtp":
            return "on CUDA the next-token layer does not get the model's hidden rows from the captured decode step"
        if not isinstance(model, CausalLM) or not isinstance(model.graphs, GraphDecode):
            if isinstance(model, CausalLM) and model.batch_invariant:
                return ("--deterministic's per-row products read the weights once per row, so a verify step "
                        "would cost what decoding its rows one by one does")
            reason = executors.graph_step_declines(model) if isinstance(model, CausalLM) else "not a decoder-only model"
            return f"this model's CUDA decode step is not captured ({reason}); its eager products are not checked"
        if any(getattr(layer, "moe", None) is not None for layer in model.layers):
            return "a mixture of experts' grouped GEMMs take each expert's rows, whose count drafts would change"
        if any(getattr(layer, "mla", None) is not None for layer in model.layers):
            return "attention over latent rows is checked at one length only"
        graphs = model.graphs
        graphs.widen(self.kv.n_slots * rows_per_slot)
        try:
            with torch.inference_mode():
                why = graph_verify.check(graphs, self.kv)
        except Exception as exc:  # out of memory capturing the wider steps, say: decline, never fail the start
            log.exception("checking verify steps on CUDA failed")
            why = f"the check failed: {exc}"
        for i in range(self.kv.n_slots):
            self.kv.clear(i)
            self.memory.clear(i)
        if why:
            graphs.widen(0)
            return f"the captured CUDA step is not row-invariant here: {why}"
        self.verify = graph_verify.VerifyRows(graphs, self.kv, model.config.n_heads)
        return ""

    def verify_rows(self, positions: list[int], prefilling: bool) -> list[int] | None:
        """The most rows each decoding slot (at `positions`) may feed this step (graph_verify.VerifyRows), or None
        where any number computes as one per step does (the CPU kernels)."""
        return None if self.verify is None else self.verify.rows(positions, prefilling)

    def warm_up(self, ctx_size: int) -> None:
        """One short prefill and one decode step before serving, so the first request (often a conversation
        resumed after a restart) does not pay the kernels' one-time set-up; the slots it used are left empty."""
        # Captured decode (GraphDecode): the graph of every batch size for short conversations now, not in a
        # request. The CPU decode steps (CpuDecode, NativeDecode) capture nothing.
        batches = self.model.warm_up_batches()
        with torch.inference_mode():
            for chunks in warm_up_steps(ctx_size, self.kv.n_slots, batches):
                self.forward(chunks)
        torch.set_num_threads(self.step_threads.compute)  # this thread's count as the engine found it
        for i in range(min(max(batches, default=1), self.kv.n_slots)):
            self.kv.clear(i)
            self.memory.clear(i)
        self.build_rope_tables(ctx_size)
        if self.verify is not None:  # now, not as a pause in the first step that drafts
            with torch.inference_mode():
                self.verify.measure()

    def build_rope_tables(self, ctx_size: int) -> None:
        """The RoPE cos/sin rows of every position a slot can hold, on each stage, now. Grown on demand they were
        built by the first request past the warm-up's few positions, twice for a conversation resumed after a
        restart (at its length, then at double for its first decoded token), each time in fresh memory: about
        2,600 page faults in an LFM2-shaped model's first request at 2,051 tokens."""
        devices = list(dict.fromkeys(device for device, _, _ in self.model.stages))
        for table in self.model.rope_tables():
            for device in devices:
                table.get(ctx_size, device, self.model.dtype)


def warm_up_steps(ctx: int, n_slots: int, batches: list[int]) -> list[list[SeqChunk]]:
    """The steps a warm-up runs (the model's and a draft model's): a short prefill in slot 0, one decode row, then
    a step of each of `batches` rows, a slot's several rows past one per slot (a verify step's, graph_verify.py),
    as far as a context of `ctx` tokens holds them. None when not even a one-token prompt fits."""
    from engine.model.llama import SeqChunk

    if ctx < 2:
        return []
    prompt = torch.zeros(min(8, ctx - 1), dtype=torch.int64)
    steps = [[SeqChunk(0, 0, prompt)], [SeqChunk(0, len(prompt), prompt[:1])]]
    for rows in batches:
        if len(prompt) + (rows - 1) // n_slots < ctx - 1:  # rows a context this short can hold
            steps.append([SeqChunk(i % n_slots, len(prompt) + i // n_slots, prompt[:1]) for i in range(rows)])
    return steps
