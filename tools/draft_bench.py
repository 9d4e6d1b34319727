"""Speculative decoding with a draft model (`--spec draft`): decode speed with and without it, and a switch-back's
time to its first tokens with the draft's rows restored with the conversation or re-read, in one run.

    python tools/draft_bench.py [--model PATH] [--draft PATH | --draft-layers N] [--rounds 3] [--max-tokens 256]

Without --draft, the draft is the model's own first --draft-layers layers (with its embeddings, final norm and
output), written as a GGUF beside nothing else: a stand-in where no smaller model of the same vocabulary is at
hand, whose acceptance says little of a real draft's. The replay is tools/spec_bench.py's (a file repeated with one
edit); the decode rate is the streamed tokens after the first over their time, the median of --rounds, the engines
loaded side by side. The switch-back: the replay's conversation, another one that displaces it (one slot, parked in
RAM), then the replay's next turn, restored; timed with the draft's part restored, and with the draft's cache
purged before the switch-back (the draft re-reads the conversation, 512 tokens per decode step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cli import sleeping_cpu_workers  # noqa: E402 - torch-free; must run before torch loads

sleeping_cpu_workers()  # the OpenMP wait policy `strata serve` runs with

from engine.config import EngineConfig  # noqa: E402
from engine.runtime.engine import Engine  # noqa: E402
from engine.runtime.requests import GenerationRequest, SamplingParams  # noqa: E402
from tools.llama_cpp_compare import cpu_description, load, model_path  # noqa: E402
from tools.spec_bench import replay_messages, strata_decode  # noqa: E402


def truncated_gguf(src: str, dst: str, n_layers: int) -> str:
    """A GGUF of `src`'s first `n_layers` blocks and every other tensor, its metadata as `src`'s but the block
    count; returns `dst`."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(dst, arch)
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = n_layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = [t for t in reader.tensors
            if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers)]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst


def _prompt(engine: Engine, messages: list[dict]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat(messages), add_special_tokens=False)


def _timed(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """(time to first token, time to the last, the tokens) of one greedy answer, in seconds from submitting."""
    t0 = time.perf_counter()
    stream = engine.submit(GenerationRequest(f"draft-bench-{time.monotonic_ns()}", prompt,
                                             SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    tokens: list[int] = []
    first = last = 0.0
    for event in stream:
        assert event.error is None, event.error
        if event.token_id is not None:
            tokens.append(event.token_id)
            last = time.perf_counter() - t0
            first = first or last
    return first, last, tokens


def switch_back(engine: Engine, first_answer: list[int], purge_draft: bool, max_tokens: int) -> dict:
    """The replay's conversation displaced and asked again: its restore's figures."""
    messages = replay_messages()
    _timed(engine, _prompt(engine, messages), 1)  # the conversation in the slot (its answer is known)
    _timed(engine, _prompt(engine, [{"role": "user", "content": "Name three rivers of Europe."}]), 8)
    if purge_draft and engine.control.draft_cache is not None:
        engine.call(lambda: engine.control.draft_cache.purge("all")).result()
    turn = [*messages, {"role": "assistant", "content": engine.tokenizer.decode(first_answer)},
            {"role": "user", "content": "Now repeat it once more, unchanged."}]
    ttft, total, tokens = _timed(engine, _prompt(engine, turn), max_tokens)
    record = engine.call(lambda: engine.stats.requests.snapshot()[-1]).result()
    return {"ttft": ttft, "total": total, "tokens": tokens, "source": record.source, "reused": record.reused_tokens,
            "draft_reused": record.spec_draft_reused}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a GGUF file or HF folder (default: the bundled model)")
    p.add_argument("--draft", default="", help="the draft model (default: the model's first --draft-layers)")
    p.add_argument("--draft-layers", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--draft-max", type=int, default=8)
    args = p.parse_args(argv)
    print(f"CPU: {cpu_description()}; load at start {load()}")
    with tempfile.TemporaryDirectory() as tmp:
        draft = args.draft or truncated_gguf(model_path(args.model), os.path.join(tmp, "draft.gguf"),
                                             args.draft_layers)
        base = EngineConfig(model=args.model, ctx_size=4096, conversation_cache_storage="ram",
                            conversation_cache_min_free_mib=0)
        engines = {"off": Engine.from_config(base),
                   "draft": Engine.from_config(base.replace(spec="draft", model_draft=draft,
                                                            spec_draft_max=args.draft_max))}
        try:
            rates: dict[str, list[float]] = {k: [] for k in engines}
            answers: dict[str, list[int]] = {}
            for _ in range(args.rounds):
                for key, engine in engines.items():
                    rate, answers[key] = strata_decode(engine, replay_messages(), args.max_tokens)
                    rates[key].append(rate)
            counters = dict(engines["draft"].stats.counters)
            backs = {name: switch_back(engines[key], answers["off"], purge, 64)
                     for name, key, purge in (("off", "off", False), ("draft restored", "draft", False),
                                              ("draft re-read", "draft", True))}
        finally:
            for engine in engines.values():
                engine.close()
    off, on = statistics.median(rates["off"]), statistics.median(rates["draft"])
    drafted, accepted = counters["spec_drafted_tokens"], counters["spec_accepted_tokens"]
    print(f"draft: {args.draft or f'the model’s first {args.draft_layers} layers'}")
    print(f"decode --spec off:   {off:6.1f} tok/s ({len(answers['off'])} tokens; rounds "
          f"{', '.join(f'{r:.1f}' for r in rates['off'])})")
    print(f"decode --spec draft: {on:6.1f} tok/s, {on / off:.2f}x; accepted {accepted} of {drafted} drafted "
          f"({accepted / max(drafted, 1):.0%}); rounds {', '.join(f'{r:.1f}' for r in rates['draft'])}")
    same = answers["off"] == answers["draft"]
    for name, b in backs.items():
        print(f"switch-back, {name:14s}: from {b['source']}, {b['reused']} tokens reused, draft held "
              f"{b['draft_reused']}; first token {b['ttft'] * 1000:7.1f} ms, {len(b['tokens'])} tokens in "
              f"{b['total'] * 1000:7.1f} ms")
    same = same and all(b["tokens"] == backs["off"]["tokens"] for b in backs.values())
    print(f"answers token-identical: {same}")
    print(f"load at end {load()}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
