"""The Settings tab's words: a label for every setting and plain-language messages for refused values.

The engine's own messages name the flag (`--conversation-cache-disk-mib: expected ...`): right for the command
line and the logs, not for a form. Here each says which field, what it takes, and what was typed.
"""

from __future__ import annotations

import re
from typing import Any

from desktop.settings import format_bytes, format_mib, is_budget
from engine.config import all_settings
from engine.setting import Setting, SettingError

GROUPS = (("model", "Model"), ("cache", "Conversation cache"), ("server", "Server"), ("runtime", "Runtime"))
LABELS = {name: spec.label for name, spec, _ in all_settings()}  # declared with each setting (engine/config.py)
STORAGE_HELP = {
    "ram": "ram — in memory: fastest; gone when the engine stops",
    "disk": "disk — in files: nothing kept in memory; survives restarts",
    "tiered": "tiered — memory first; evictions and shutdown spill to disk",
}
SPEC_HELP = {
    "off": "off — one token per decode step",
    "prompt-lookup": "prompt lookup — drafts from the conversation and recent answers; the same answers, faster on repeats",
    "draft": "draft model — a smaller model of the same vocabulary drafts (Draft model); the same answers",
    "mtp": "next-token layer — the model's own MTP layer drafts (GLM-4.x, DeepSeek-V3, Qwen3.5, …); the same answers",
}
CHOICE_WORDS = {"conversation_cache_storage": STORAGE_HELP, "spec": SPEC_HELP}  # a choice shown in words
SIZE_UNITS = (("PiB", 1 << 30), ("TiB", 1 << 20), ("GiB", 1 << 10), ("MiB", 1))
# What 0 means, said under the field when it holds 0, for every setting that takes 0 (engine/config.py's help
# texts and the code behind them); the port's 0 is said by its warning (risk_warning).
ZERO_WORDS = {
    "moe_cpu_layers": "0 = none: experts stay where Experts on puts them",
    "threads": "0 = automatic: PyTorch's default number of threads",
    "decode_threads": "0 = automatic: one thread or CPU threads, whichever decodes faster, timed as the engine runs",
    "side_call_tokens": "0 = off: a short call takes a slot like any other request",
    "queue_timeout": "0 = no limit: a request waits for a free slot as long as it takes",
    "n_predict": "0 = no limit but the context",
    "conversation_cache_mib": "0 = no RAM parking",
    "conversation_cache_disk_mib": "0 = no disk parking: every park to disk is refused",
    "conversation_cache_write_buffer_mib": "0 = nothing waits in RAM: each disk write is done before the switch "
                                           "continues",
    "conversation_cache_min_free_mib": "0 = no floor: a RAM park is refused only when the memory available "
                                       "cannot hold it",
    "conversation_cache_days": "0 = the folder is emptied at every start",
    "conversation_cache_checkpoint_tokens": "0 = at each prompt's end only",
    "conversation_cache_n_min": "0 = automatic: the cost model decides",
    "conversation_cache_similarity": "0 = off: a hit of any share may be restored (the cost model decides)",
}
APPLIES_LIVE = "applies live"
APPLIES_AT_RESTART = "applies after a restart"


def label_of(name: str) -> str:
    """The words a setting is shown with, as its declaration gives them."""
    return LABELS[name]


def applies_words(spec: Setting) -> str:
    """When a change reaches the engine: "applies live" or "applies after a restart"."""
    return APPLIES_LIVE if spec.live else APPLIES_AT_RESTART


def zero_words(name: str, value: Any) -> str:
    """What 0 means for this setting when `value` is 0 ("" otherwise, or where 0 means nothing special)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != 0:
        return ""
    return ZERO_WORDS.get(name, "")


def value_words(spec: Setting, value: Any) -> str:
    """A setting's value as the form would say it: "16 GiB", "8192 tokens", "off", "empty"."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if is_budget(spec) and isinstance(value, int):
        return format_mib(value)
    if isinstance(value, int | float):
        number = _number(value)
        return f"{number} {spec.unit}" if spec.unit else number
    return str(value) if value != "" else "empty"


def group_note(names: list[str], specs: dict[str, Setting]) -> str:
    """How a group's settings reach a running engine, said once above them."""
    later = [n for n in names if not specs[n].live]
    if len(later) == len(names):
        return "These apply when the engine starts: after a restart if it is running."
    if not later:
        return "These apply live to the running engine."
    labels = [label_of(n) for n in later]
    listed = labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]
    which = "which applies" if len(labels) == 1 else "which apply"
    return f"These apply live to the running engine, except {listed}, {which} after a restart."


def size_words(mib: float) -> str:
    """0 -> "0 MiB", 1 << 30 -> "1 PiB", 1536 -> "1.5 GiB": the largest unit the size reaches."""
    for unit, scale in SIZE_UNITS:
        if mib >= scale:
            return f"{mib / scale:g} {unit}"
    return f"{mib:g} MiB"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _range(spec: Setting, unit: str = "") -> str:
    lo, hi = spec.minimum, spec.maximum
    suffix = f" {unit}" if unit else ""
    if lo is not None and hi is not None:
        return f" from {_number(lo)}{suffix} to {_number(hi)}{suffix}"
    if lo is not None:
        return f" of at least {_number(lo)}{suffix}"
    if hi is not None:
        return f" of at most {_number(hi)}{suffix}"
    return ""


FLAG_TO_LABEL = {spec.flag: label_of(name) for name, spec, _ in all_settings()}
FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def plain_error(name: str, spec: Setting, text: str, error: SettingError, budget: bool = False) -> str:
    """A refused value in words: 'Disk budget must be a size from 0 MiB to 1 PiB, in whole MiB or ... not "-5".'"""
    label = label_of(name)
    typed = text.strip()
    if typed == "" and spec.kind in ("int", "float", "path"):
        return f"{label} needs a value."
    if budget:
        lo = size_words(spec.minimum or 0)
        hi = size_words(spec.maximum) if spec.maximum is not None else "any size"
        return f'{label} must be a size from {lo} to {hi}, in whole MiB or in GiB (e.g. 4096 or 4 GiB), not "{typed}".'
    if spec.kind == "int":
        return f'{label} must be a whole number{_range(spec, spec.unit)}, not "{typed}".'
    if spec.kind == "float":
        return f'{label} must be a number{_range(spec, spec.unit)}, not "{typed}".'
    if spec.kind == "choice":
        return f"{label} must be one of " + ", ".join(spec.choices) + f', not "{typed}".'
    # Anything else (a rule across settings, say): the engine's words with each flag named as its field.
    message = str(error)
    message = re.sub(r"^--[a-z0-9-]+: ", "", message)
    message = FLAG.sub(lambda m: FLAG_TO_LABEL.get(m.group(0), m.group(0)), message)
    return f"{label}: {message[:1].lower()}{message[1:]}" if not message.startswith(label) else message


DECIMAL_UNIT = re.compile(r"\d\s*(gb|tb|mb)\s*$", re.IGNORECASE)


def risk_warning(name: str, value: object, text: str, host_ram: int | None, free_disk: int | None) -> str:
    """A value that is accepted but likely not what was meant, in words ("" when nothing looks risky)."""
    warnings = []
    if name == "port" and isinstance(value, int):
        if value == 0:
            warnings.append("0 lets the system pick a different free port at every start: clients cannot know it")
        elif value < 1024:
            warnings.append("ports below 1024 need administrator rights on most systems")
    if isinstance(value, int) and not isinstance(value, bool):
        size = value * (1 << 20)
        if name in ("conversation_cache_mib", "conversation_cache_min_free_mib") and host_ram and size > host_ram:
            warnings.append(f"more than this computer's RAM ({size_words(host_ram / (1 << 20))})")
        if name == "conversation_cache_disk_mib" and free_disk is not None and size > free_disk:
            warnings.append(f"more than the free space on disk ({size_words(free_disk / (1 << 20))})")
    m = DECIMAL_UNIT.search(text or "")
    if m and name.endswith("_mib"):
        unit = m.group(1).upper()
        warnings.append(f"{unit} read as {unit[0]}iB (1024-based)")
    return "; ".join(warnings)


def arena_words(arena: int, budget_mib: int, floor_mib: int, host_ram: int | None, mode: str) -> tuple[str, bool]:
    """What a mixture-of-experts model's expert arena (routed experts in host RAM, `arena` bytes) leaves for
    RAM parking, and whether that is a warning: too little room beside it, where disk storage fits ("" without
    an arena)."""
    if arena <= 0:
        return "", False
    mib = 1 << 20
    text = f"the model's expert arena holds {format_bytes(arena)} of RAM"
    room = (host_ram or 0) - arena - floor_mib * mib  # at most: the system and other programs need RAM too
    if host_ram and mode != "disk" and budget_mib * mib > room:
        return (f"{text}, leaving at most {format_bytes(max(room, 0))} above the floor: RAM parks will be refused"
                " — disk storage keeps parking"), True
    return text, False
