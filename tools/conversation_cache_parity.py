"""A/B/A parity of the conversation cache: a restored conversation is exactly the one that never left.

For each scenario, two engines with the same settings run in this process (no sockets):
- reference: conversation A's turns back to back, A never leaves its slot;
- switched: A, then B (which takes A's slot and parks A), then A again (restored from the cache).
Checks: the restored slot's K/V rows are byte-identical to what A held when parked, A's greedy continuation is
token-identical to the reference, and the cache really reused the tokens (usage.cached_tokens).

With --restart (disk, tiered) it also runs the sequence of a user who restarts: on one engine A, B, A's second
turn; a new engine on the same folder (with --restart-layout, another device layout: a split's conversations
resumed on one stage) runs B, then A's second turn again, reusing all of its prompt. The answer must be the first
engine's, token for token, and the second engine's slot must end byte-identical to the first engine's (the
recomputed last prompt token and every generated row included).

    python tools/conversation_cache_parity.py [--storage ram|disk|tiered] [--model PATH] [--devices cpu,cpu ...]
        [--cpu-weights auto|float|int4|float16] [--restart] [--restart-layout DEVICES[/SPLIT]] [--spec prompt-lookup]
A hybrid model (recurrent layers + attention) is checked the same way, and its slot's recurrent state after A's
second turn must be byte-identical to the reference's (or the first engine's); no restore may leave the prefill to
start elsewhere than where it restored (`restores_without_reuse` stays 0).
A sliding-window model (Gemma 3, Mistral) parks its local layers' last window only: the restored K/V is compared
as a continuation reads it (global layers every row, local layers from the slot's floor on), and the edited
scenario, which leaves A before that window, must prefill with reason `window` and the same output.
Exit status 0 when every scenario passes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.config import CPU_WEIGHTS, EngineConfig  # noqa: E402
from engine.runtime.engine import Engine  # noqa: E402
from engine.runtime.memory import RecurrentMemory, WindowMemory  # noqa: E402
from engine.runtime.requests import GenerationRequest, SamplingParams  # noqa: E402

SCENARIOS = ("basic", "shared-system", "edited", "parallel", "pressure")
FILLER = (
    "The river bends twice before the mill, and the old road follows it past the orchard where the "
    "apples ripen late. "
)


@dataclass
class Outcome:
    name: str
    passed: bool
    detail: str


def _text(n_words: int, seed: int) -> str:
    words = (FILLER * (n_words // 10 + 2)).split()
    rng = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(words), generator=rng).tolist()
    return " ".join(words[i] for i in order[:n_words])


def _generate(engine: Engine, messages: list[dict], max_tokens: int) -> tuple[str, list[int], int]:
    prompt = engine.tokenizer.encode(engine.tokenizer.render_chat(messages), add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    stream = engine.submit(GenerationRequest(f"parity-{id(messages)}", prompt, params))
    text, tokens, cached = "", [], 0
    for event in stream:
        assert event.error is None, event.error
        text += event.text
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.usage is not None:
            cached = event.usage.cached_tokens
    return text, tokens, cached


def _slot_kv(engine: Engine, slot: int) -> tuple[list[int], torch.Tensor]:
    def read():
        s = engine.slots[slot]
        return list(s.tokens), engine.kv.read(slot, 0, len(s.tokens))

    return engine.call(read).result()


def _slot_state(engine: Engine, slot: int) -> tuple[int, bytes] | None:
    """A hybrid model's slot: (its recurrent state's position, the state's bytes); None for attention only."""
    memory = engine.memory
    if not isinstance(memory, RecurrentMemory):
        return None

    def read():
        snap = memory.states.read(slot)
        return snap.position, b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in snap.tensors)

    return engine.call(read).result()


def _floor(engine: Engine, slot: int) -> int:
    """A sliding-window model's slot: the first row its local layers hold as the conversation's own (a restore
    writes only the last window of them); 0 for every other model."""
    memory = engine.memory
    return engine.call(lambda: memory.windows.floors[slot]).result() if isinstance(memory, WindowMemory) else 0


def _read_rows(engine: Engine, kv: torch.Tensor, floor: int) -> torch.Tensor:
    """`kv` as a continuation reads it: a sliding-window model's local rows before `floor` zeroed (never read)."""
    if not isinstance(engine.memory, WindowMemory) or floor == 0:
        return kv
    out = kv.clone()
    out[engine.memory.windows.local, :, :floor] = 0
    return out


def _last_reason(engine: Engine) -> str:
    return engine.call(lambda: engine.requests.snapshot()[-1].reason).result()


def _silent_restores(engine: Engine) -> int:
    """Restores after which the prefill did not start where they restored (must stay 0)."""
    return engine.call(engine.engine_stats).result().restores_without_reuse


def _conversation(system: str, first: str, seed: int) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": first + " " + _text(40, seed)}]


def run_scenario(name: str, base: dict, n_words: int, max_tokens: int) -> Outcome:
    """Run one scenario; returns whether it passed and what was seen."""
    overrides = dict(base)
    if name == "parallel":
        overrides["parallel"] = 2
    with tempfile.TemporaryDirectory() as tmp:
        if name == "pressure":
            overrides["conversation_cache_slots"] = 1  # B's park evicts A: A must fall back to a full prefill
        # Separate folders: the switched engine must not find what the reference engine parked on disk.
        config = EngineConfig(**{"conversation_cache_dir": os.path.join(tmp, "reference"), **overrides})
        switched_config = config.replace(conversation_cache_dir=os.path.join(tmp, "switched"))
        system_a = "You are a careful assistant. " + _text(n_words, 1)
        system_b = system_a if name == "shared-system" else "You write short poems. " + _text(n_words, 2)
        conv_a = _conversation(system_a, "Summarise this for me.", 3)
        conv_b = _conversation(system_b, "Write about the sea.", 4)
        c_words = "Now list three details you noticed."

        # Reference: A's two turns back to back.
        ref = Engine.from_config(config)
        try:
            a1, _, _ = _generate(ref, conv_a, max_tokens)
            turn2 = conv_a + [{"role": "assistant", "content": a1}, {"role": "user", "content": c_words}]
            if name == "edited":
                turn2[1] = {"role": "user", "content": "Summarise this briefly. " + _text(40, 3)}
            a2_ref, a2_ref_tokens, _ = _generate(ref, turn2, max_tokens)
            ref_state = _slot_state(ref, 0)
        finally:
            ref.close()

        eng = Engine.from_config(switched_config)
        try:
            a1_sw, _, _ = _generate(eng, conv_a, max_tokens)
            if a1_sw != a1:
                return Outcome(name, False, "first turn differs between two identical engines")
            parked_tokens, parked_kv = _slot_kv(eng, 0)
            if name == "pressure":
                _generate(eng, _conversation("Another task. " + _text(n_words, 7), "Go.", 8), 4)
            _generate(eng, conv_b, max_tokens)  # takes slot 0 (or slot 1 with --parallel 2)
            if name == "parallel":
                # Fill both slots with other conversations so A must come back through the cache: each longer
                # than A, so the slot choice (fewest tokens lost first) takes A's and B's slots, not each other's.
                for i, seed in enumerate((5, 9)):
                    _generate(eng, _conversation(f"Other {i}. " + _text(n_words + 30, seed), "Go.", seed + 1), 4)
            a2, a2_tokens, cached = _generate(eng, turn2, max_tokens)
            stats = eng.call(eng.cache_stats).result()
            slot = next(s.id for s in eng.slots if s.tokens[: len(parked_tokens) // 2] == parked_tokens[: len(parked_tokens) // 2])
            restored_tokens, restored_kv = _slot_kv(eng, slot)
            state, silent = _slot_state(eng, slot), _silent_restores(eng)
            floor, reason = _floor(eng, slot), _last_reason(eng)
            drafting = _drafting(eng)
            restored_kv, parked_kv = _read_rows(eng, restored_kv, floor), _read_rows(eng, parked_kv, floor)
        finally:
            eng.close()

    if a2_tokens != a2_ref_tokens:
        return Outcome(name, False, f"continuation differs: {a2!r} vs reference {a2_ref!r}")
    if drafting.startswith("declined"):
        return Outcome(name, False, f"--spec {base['spec']} {drafting}")
    if silent:
        return Outcome(name, False, f"{silent} restores did not resume where they restored (restores_without_reuse)")
    # a hybrid model: the recurrent state after A's second turn is the reference's, byte for byte (not under
    # pressure: A evicted is computed again from another start, equal to the reference only to float rounding)
    if name != "pressure" and state != ref_state:
        return Outcome(name, False, "the slot's recurrent state differs from the never-parked reference's")
    if name == "pressure":
        ok = cached == 0 or stats.get("evictions", 0) > 0
        return Outcome(name, ok, f"evictions={stats.get('evictions')} cached_tokens={cached}; output identical")
    if name == "edited" and reason == "window":  # a sliding-window model keeps no window before the edit
        return Outcome(name, True, f"edited before the parked window: reason window, cached_tokens={cached} (the "
                                   "live slot's), output identical")
    if stats.get("restores", 0) < 1 or cached == 0:
        return Outcome(name, False, f"no restore happened (restores={stats.get('restores')}, cached={cached})")
    n = min(cached, len(parked_tokens))
    if restored_tokens[:n] != parked_tokens[:n]:
        return Outcome(name, False, "restored token ids differ from the parked ones")
    same = torch.equal(restored_kv[:, :, :n].view(torch.uint8), parked_kv[:, :, :n].view(torch.uint8))
    if not same:
        return Outcome(name, False, f"restored K/V differs from the parked K/V over {n} tokens")
    hybrid = ", recurrent state byte-identical" if state is not None else ""
    return Outcome(name, True, f"{n} tokens restored byte-identical, {len(a2_tokens)} tokens identical, "
                               f"cached_tokens={cached}{hybrid}{drafting}")


def _drafting(engine: Engine) -> str:
    """With speculation on, what the engine drafted (so a pass is known to have verified drafts): '' when off,
    'declined: <why>' when the engine declined it."""
    speculation = engine.scheduler.speculation
    if speculation.method == "off":
        return ""
    if speculation.declined:
        return f"declined: {speculation.declined}"
    drafted, accepted = engine.call(lambda: (engine.stats.counters["spec_drafted_tokens"],
                                             engine.stats.counters["spec_accepted_tokens"])).result()
    return f", drafts accepted {accepted} of {drafted}"


def run_resplit(base: dict, other: dict, n_words: int, max_tokens: int) -> Outcome:
    """A parked under one device layout (at shutdown, disk or tiered) resumes under another: K/V per layer."""
    name = f"resplit->{other.get('devices')}/{other.get('layer_split') or 'one'}"
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(**{"conversation_cache_dir": os.path.join(tmp, "reference"), **base})
        assert config.conversation_cache_storage in ("disk", "tiered"), "resplit needs disk or tiered storage"
        conv_a = _conversation("You are a careful assistant. " + _text(n_words, 1), "Summarise this.", 3)
        ref = Engine.from_config(config)
        try:
            a1, _, _ = _generate(ref, conv_a, max_tokens)
            turn2 = conv_a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Go on."}]
            _, a2_ref_tokens, _ = _generate(ref, turn2, max_tokens)
        finally:
            ref.close()
        shared = os.path.join(tmp, "shared")
        first = Engine.from_config(config.replace(conversation_cache_dir=shared))
        try:
            _generate(first, conv_a, max_tokens)
            parked_tokens, parked_kv = _slot_kv(first, 0)
        finally:
            first.close()  # parks the live slot on disk
        second = Engine.from_config(config.replace(conversation_cache_dir=shared, **other))
        try:
            _, a2_tokens, cached = _generate(second, turn2, max_tokens)
            _, restored_kv = _slot_kv(second, 0)
            floor = _floor(second, 0)
            restored_kv, parked_kv = _read_rows(second, restored_kv, floor), _read_rows(second, parked_kv, floor)
        finally:
            second.close()
    if a2_tokens != a2_ref_tokens:
        return Outcome(name, False, "continuation differs from the never-parked reference")
    if cached < len(parked_tokens) // 2:
        return Outcome(name, False, f"only {cached} of {len(parked_tokens)} tokens reused")
    n = min(cached, len(parked_tokens))
    same = torch.equal(restored_kv[:, :, :n].view(torch.uint8), parked_kv[:, :, :n].view(torch.uint8))
    return Outcome(name, same, f"{n} tokens restored {'byte-identical' if same else 'DIFFERENT'}, "
                               f"{len(a2_tokens)} tokens identical")


def run_restart(base: dict, other: dict, n_words: int, max_tokens: int) -> Outcome:
    """A, B, A2 on one engine; stop; B, A2 on a new engine over the same folder (with `other` settings)."""
    layout = f"{other.get('devices', base['devices'])}/{other.get('layer_split', base.get('layer_split')) or 'one'}"
    name = f"restart->{layout}"
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(**{"conversation_cache_dir": tmp, **base})
        assert config.conversation_cache_storage in ("disk", "tiered"), "a restart needs disk or tiered storage"
        conv_a = _conversation("You are a careful assistant. " + _text(n_words, 1), "Summarise this for me.", 3)
        conv_b = _conversation("You write short poems. " + _text(n_words, 2), "Write about the sea.", 4)
        first = Engine.from_config(config)
        try:
            a1, _, _ = _generate(first, conv_a, max_tokens)
            _generate(first, conv_b, max_tokens)  # parks A
            turn2 = conv_a + [{"role": "assistant", "content": a1},
                              {"role": "user", "content": "Now list three details you noticed."}]
            _, x_tokens, _ = _generate(first, turn2, max_tokens)  # A restored, its new turn prefilled
            first_tokens, first_kv = _slot_kv(first, 0)
            first_state, first_floor = _slot_state(first, 0), _floor(first, 0)
        finally:
            first.close()  # parks A (with its answer) on disk
        second = Engine.from_config(config.replace(**other))
        try:
            _generate(second, conv_b, max_tokens)
            _, y_tokens, cached = _generate(second, turn2, max_tokens)
            n_prompt = len(second.tokenizer.encode(second.tokenizer.render_chat(turn2), add_special_tokens=False))
            stats = second.call(second.cache_stats).result()
            second_tokens, second_kv = _slot_kv(second, 0)
            second_state, silent = _slot_state(second, 0), _silent_restores(second)
            floor = max(first_floor, _floor(second, 0))
            first_kv, second_kv = _read_rows(second, first_kv, floor), _read_rows(second, second_kv, floor)
        finally:
            second.close()
    if stats.get("restores", 0) < 1 or cached < n_prompt - 1:
        return Outcome(name, False, f"A was not restored whole (restores={stats.get('restores')}, "
                                    f"cached_tokens={cached} of {n_prompt})")
    if y_tokens != x_tokens:
        return Outcome(name, False, f"continuation differs from the first engine's ({len(x_tokens)} tokens)")
    if second_tokens != first_tokens:
        return Outcome(name, False, "the slots hold different tokens")
    if silent:
        return Outcome(name, False, f"{silent} restores did not resume where they restored (restores_without_reuse)")
    if second_state != first_state:
        return Outcome(name, False, "the slots' recurrent states differ")
    diff = second_kv.view(torch.uint8) != first_kv.view(torch.uint8)  # bytes: [layers, 2, tokens, ...]
    rows = diff.transpose(0, 2).flatten(1).any(1).nonzero().flatten().tolist()
    if rows:
        return Outcome(name, False, f"K/V rows differ from the first engine's at positions {rows[:4]} "
                                    f"(the prompt has {n_prompt} tokens)")
    return Outcome(name, True, f"cached_tokens={cached} of {n_prompt}, {len(y_tokens)} tokens identical, "
                               f"{len(second_tokens)} K/V rows byte-identical")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", choices=("ram", "disk", "tiered"), default="ram")
    parser.add_argument("--model", default="", help="model path (default: the bundled model)")
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--layer-split", default="")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--words", type=int, default=300, help="words of system prompt per conversation")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="run only these (repeatable)")
    parser.add_argument("--resplit", action="append", default=[], metavar="DEVICES[/SPLIT]",
                        help="also park under --devices/--layer-split and resume under this layout (disk, tiered)")
    parser.add_argument("--cpu-weights", default="auto", choices=CPU_WEIGHTS)
    parser.add_argument("--moe-experts", default="gpu", choices=("gpu", "cpu"), help="the engine's --moe-experts")
    parser.add_argument("--moe-cpu-layers", type=int, default=0, help="the engine's --moe-cpu-layers")
    parser.add_argument("--deterministic", action="store_true", help="the engine's --deterministic (CUDA)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="the engine's --no-cuda-graphs")
    parser.add_argument("--spec", default="off", choices=("off", "prompt-lookup"),
                        help="the engine's --spec, in both engines: restores with drafting on")
    parser.add_argument("--checkpoint-tokens", type=int, default=1024,
                        help="hybrid models: --conversation-cache-checkpoint-tokens (the edited scenario resumes "
                             "from the deepest checkpoint before the edit)")
    parser.add_argument("--restart", action="store_true",
                        help="also run A, B, A2; restart; B, A2 (disk, tiered) on the same device layout")
    parser.add_argument("--restart-layout", action="append", default=[], metavar="DEVICES[/SPLIT]",
                        help="also run that sequence with the second engine on this layout (repeatable)")
    args = parser.parse_args(argv)
    base = {
        "cpu_weights": args.cpu_weights,
        "model": args.model,
        "devices": args.devices,
        "layer_split": args.layer_split,
        "dtype": args.dtype,
        "kv_dtype": args.kv_dtype,
        "ctx_size": 4096,
        "conversation_cache_storage": args.storage,
        "conversation_cache_min_free_mib": 0,
        "deterministic": args.deterministic,
        "moe_experts": args.moe_experts,
        "moe_cpu_layers": args.moe_cpu_layers,
        "no_cuda_graphs": args.no_cuda_graphs,
        "spec": args.spec,
        "conversation_cache_checkpoint_tokens": args.checkpoint_tokens,
    }
    failed = 0
    for name in args.scenario or SCENARIOS:
        outcome = run_scenario(name, base, args.words, args.max_tokens)
        failed += not outcome.passed
        print(f"{'PASS' if outcome.passed else 'FAIL'} {args.storage:6s} {name:14s} {outcome.detail}", flush=True)
    for layout in args.resplit if args.storage != "ram" else []:
        devices, _, split = layout.partition("/")
        outcome = run_resplit(base, {"devices": devices, "layer_split": split}, args.words, args.max_tokens)
        failed += not outcome.passed
        print(f"{'PASS' if outcome.passed else 'FAIL'} {args.storage:6s} {outcome.name:14s} {outcome.detail}",
              flush=True)
    restarts = ([{}] if args.restart else []) + [
        {"devices": d, "layer_split": sp} for d, _, sp in (layout.partition("/") for layout in args.restart_layout)]
    for other in restarts if args.storage != "ram" else []:
        outcome = run_restart(base, other, args.words, args.max_tokens)
        failed += not outcome.passed
        print(f"{'PASS' if outcome.passed else 'FAIL'} {args.storage:6s} {outcome.name:14s} {outcome.detail}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
