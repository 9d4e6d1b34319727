"""The engine's settings: one declaration per setting, read by the CLI, the HTTP API and the desktop app.

Every setting is a field of `EngineConfig` whose metadata (`Setting`) carries its flag, label, UI kind, help text,
unit, bounds and whether it can change on a running engine. `engine.cli` builds argparse from it, `PUT /cache/config`
validates with it, and the desktop's Settings tab and settings file read it too. This module imports nothing
heavy (no torch) so the desktop app can use it without paying torch's start-up cost.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import platformdirs

from engine.setting import Setting, SettingError, setting
from engine.store_url import parse_store_url, redact_url

APP_NAME = "strata"
STORAGE_MODES = ("ram", "disk", "tiered")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# --cpu-weights: engine/runtime/startup.py resolves auto (engine/model/int4.py, engine/model/float16.py)
CPU_WEIGHTS = ("auto", "float", "int4", "float16")
PURGE_TIERS = ("ram", "disk", "all")



def weights_cache_dir() -> str:
    """Where converted CPU weights are kept between starts (--weights-cache, engine/model/weights_cache.py)."""
    return os.path.join(platformdirs.user_cache_dir(APP_NAME, appauthor=False), "weights")


def kernels_dir() -> str:
    """Where the native CPU kernels are built once per machine (engine/model/kernels)."""
    return os.path.join(platformdirs.user_cache_dir(APP_NAME, appauthor=False), "kernels")


def default_cache_dir() -> str:
    """Where parked conversations live on disk unless told otherwise (one subfolder per model identity)."""
    return os.path.join(platformdirs.user_cache_dir(APP_NAME, appauthor=False), "conversations")


@dataclass(slots=True)
class EngineConfig:
    """Everything `strata serve` can be told. Field order is the order of `--help` and the Settings tab."""

    # -- model
    model: str = setting(
        "", flag="--model", label="Model", ui="model", kind="str", group="model", metavar="PATH",
        help="GGUF file or Hugging Face folder (config.json + safetensors + tokenizer.json); "
        "empty = the bundled SmolLM2-135M-Instruct",
    )
    alias: str = setting(
        "", flag="--alias", label="Model id", kind="str", group="model", metavar="NAME",
        help="model id reported by /v1/models (default: the model file or folder name)",
    )
    dtype: str = setting(
        "auto", flag="--dtype", label="Data type", kind="choice", group="model", choices=DTYPES,
        help="compute and K/V dtype; auto = float32 on CPU, bfloat16 on CUDA (float16 where bf16 is unsupported)",
    )
    kv_dtype: str = setting(
        "auto", flag="--kv-dtype", label="K/V data type", kind="choice", group="model", choices=DTYPES,
        help="dtype the K/V of every slot and parked conversation is kept in (attention upcasts it to the compute "
        "dtype); auto = the compute dtype (--dtype): float32 on CPU, bfloat16 on CUDA (float16 where bf16 is "
        "unsupported); bfloat16 or float16 halve K/V memory and parked bytes per token against float32 (a hybrid "
        "model's attention K/V; its recurrent state stays float32)",
    )
    devices: str = setting(
        "auto", flag="--devices", label="Devices", kind="str", group="model", metavar="LIST",
        help="comma-separated devices, e.g. cpu or cuda:0,cuda:1; auto = cuda:0 when available, else cpu",
    )
    layer_split: str = setting(
        "", flag="--layer-split", label="Layer split", kind="str", group="model", metavar="auto|L1,L2,...",
        help="split layers across --devices: auto (by free memory) or layer counts per device; empty = one device",
    )
    cpu_weights: str = setting(
        "auto", flag="--cpu-weights", label="Weights on the CPU",
        kind="choice", group="model", choices=CPU_WEIGHTS,
        help="int4: projection weights as 4-bit groups on CPU (several times less memory read per token: ~3x "
        "faster decode), through the native kernel (int16 activations; shipped built for AVX-512, AVX2 and any "
        "other CPU) or PyTorch's (bfloat16 activations; where no native build loads); a tied Q8_0 "
        "output matrix is read from the file's blocks where the native kernel loads; logits differ slightly from "
        "float32; float16: as float16 through FBGEMM (half of float32's bytes, logits within ~1e-3 of float32's); "
        "float: float32 weights, logits as transformers computes them; auto: on the CPU in float32, int4 where a "
        "4-bit kernel is vectorised for this CPU (timed at start-up), else float16 (PyTorch for Windows has only a "
        "scalar 4-bit kernel), else float",
    )
    weights_cache: str = setting(
        "on", flag="--weights-cache", label="Keep converted weights",
        kind="choice", group="model", choices=("on", "off"),
        help="on: keep the 4-bit CPU weights converted from a GGUF file in the user cache folder (weights/, the 3 "
        "newest), so the next start reads them instead of converting the file again; off: convert at every start",
    )
    gpu_weights: str = setting(
        "auto", flag="--gpu-weights", label="Weights on the GPU",
        kind="choice", group="model", choices=("auto", "bf16", "int4"),
        help="int4: projection and output weights as 4-bit groups of 128 on CUDA (PyTorch's int4 weight-only "
        "kernel; ~3.8x less memory for them, ~1.4x faster decode of one conversation, slower batched decode and much "
        "slower prefill; logits differ from bf16); bf16: the model's dtype; auto: bf16",
    )
    moe_experts: str = setting(
        "gpu", flag="--moe-experts", label="Experts on", kind="choice", group="model", choices=("gpu", "cpu"),
        help="mixture-of-experts models (and Gemma 4's expert block beside its MLP): where the routed experts live; "
        "gpu: on their layer's device (--devices); "
        "cpu: every layer's experts in host RAM as 4-bit groups, run on the CPU for the tokens routed to them "
        "(attention, router and shared experts stay on the layer's device; their size is the expert arena, "
        "which the conversation cache's RAM budget must fit beside); ignored for models without experts",
    )
    moe_cpu_layers: int = setting(
        0, flag="--moe-cpu-layers", label="Expert layers on the CPU",
        kind="int", group="model", unit="layers", minimum=0, maximum=4096, metavar="N",
        help="with --moe-experts gpu: the first N layers' experts in host RAM as 4-bit groups, run on the CPU "
        "(as llama.cpp's --n-cpu-moe); at most the model's layer count; ignored for models without experts",
    )
    threads: int = setting(
        0, flag="--threads", label="CPU threads", kind="int", group="runtime", minimum=0, maximum=1024,
        help="CPU threads for compute (0 = PyTorch's default)",
    )
    decode_threads: int = setting(
        0, flag="--decode-threads", label="CPU threads for decoding", kind="int", group="runtime", minimum=0,
        maximum=1024,
        help="CPU threads for decode steps, where every row is one token (0 = timed as the engine runs: one or "
        "--threads, whichever decodes faster at the moment, starting from one for a model that reads under 256 MiB "
        "of weights a token, else --threads); prefill uses --threads",
    )
    # -- runtime
    ctx_size: int = setting(
        8192, flag="--ctx-size", label="Context length",
        kind="int", group="runtime", unit="tokens", minimum=64, maximum=1 << 20,
        help="context length of each slot (capped at the model's trained context)",
    )
    parallel: int = setting(
        1, flag="--parallel", label="Parallel slots", kind="int", group="runtime", minimum=1, maximum=256,
        help="slots decoding at once; further requests wait in a queue",
    )
    no_cuda_graphs: bool = setting(
        False, flag="--no-cuda-graphs", label="No CUDA graphs", kind="bool", group="runtime",
        help="on CUDA, run the decode step's kernels one by one instead of replaying captured graphs (one per "
        "batch size and attention length, captured on first use): the same results, slower",
    )
    deterministic: bool = setting(
        False, flag="--deterministic", label="Batch-invariant results", kind="bool", group="runtime",
        help="on CUDA, make a slot's results independent of what shares its step (per-row kernels, no graphs; "
        "slower with several slots); default: one GEMM over all rows and captured decode steps",
    )
    spec: str = setting(
        "off", flag="--spec", label="Speculative decoding", kind="choice", group="runtime",
        choices=("off", "prompt-lookup", "draft", "mtp"),
        help="prompt-lookup: draft the next tokens from the conversation's own earlier tokens (an agent repeating "
        "code it read) and from the engine's recent answers, and verify them in one decode step; draft: a smaller model of the same vocabulary "
        "(--model-draft) drafts them; mtp: the model's own next-token layer (GLM-4.x MoE, GLM-4.7-Flash, DeepSeek-V3, Qwen3-Next, Qwen3.5) drafts them, declined "
        "with a logged reason for a model without one; greedy output token-identical to off, sampled output distributed as off "
        "(rejection sampling); on CUDA through the captured decode step once a check at start finds its rows computed "
        "alike in steps of every size (declined with a logged reason otherwise, with --deterministic, and on MoE layers)",
    )
    model_draft: str = setting(
        "", flag="--model-draft", label="Draft model", kind="str", group="runtime", metavar="PATH",
        help="with --spec draft: the draft model (GGUF file or Hugging Face folder) whose vocabulary is the "
        "model's; it runs on --device-draft with K/V of its own per slot",
    )
    device_draft: str = setting(
        "", flag="--device-draft", label="Draft device", kind="str", group="runtime", metavar="DEVICE",
        help="with --spec draft: where the draft model runs, cpu or cuda:N (a GPU beside a model on the CPU: "
        "bfloat16 weights, CUDA graphs); empty = the model's first device",
    )
    spec_draft_max: int = setting(
        8, flag="--spec-draft-max", label="Most draft tokens", kind="int", group="runtime", unit="tokens",
        minimum=1, maximum=64, metavar="N",
        help="with --spec prompt-lookup, draft or mtp: the most tokens one draft proposes (the length adapts below it to how "
        "many are accepted)",
    )
    prefill_chunk: int = setting(
        512, flag="--prefill-chunk", label="Prefill chunk",
        kind="int", group="runtime", unit="tokens", minimum=16, maximum=65536,
        help="prompt tokens computed per forward pass (chunked prefill); at the default, a model whose experts live "
        "in host RAM beside a GPU takes 2048 (each chunk brings the experts to the GPU)",
    )
    side_call_tokens: int = setting(
        512, flag="--side-call-tokens", label="Side-call size", ui="line",
        kind="int", group="runtime", unit="tokens", minimum=0, maximum=1 << 20,
        help="a request with a shorter prompt that continues no slot (a title or summary call) takes the slot "
        "whose loss is cheapest, not the one sharing a few of its tokens (0 = off)",
    )
    # -- server
    host: str = setting(
        "127.0.0.1", flag="--host", label="Host", kind="str", group="server", metavar="ADDR",
        help="address to bind (127.0.0.1 keeps the server private to this machine)",
    )
    port: int = setting(
        8080, flag="--port", label="Port", kind="int", group="server", minimum=0, maximum=65535,
        help="TCP port to listen on (0 = any free port, printed at start)",
    )
    api_key: str | None = setting(
        None, flag="--api-key", label="API key",
        kind="optional_str", group="server", secret=True, metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route except GET /health",
    )
    allowed_hosts: str = setting(
        "", flag="--allowed-hosts", label="Allowed host names", kind="str", group="server", metavar="NAMES",
        help="comma-separated Host names the server also answers to, besides the bound address and 127.0.0.1, "
        "localhost, ::1 (needed to reach a server bound to 0.0.0.0 by name or IP); * = any Host (turns off the "
        "DNS-rebinding check)",
    )
    cors_origins: str = setting(
        "", flag="--cors-origins", label="Browser origins (CORS)",
        kind="str", group="server", metavar="ORIGINS",
        help="comma-separated browser origins allowed to call the API (CORS), e.g. http://localhost:3000; "
        "* = any; empty = none: pages of other sites can neither read answers nor change anything",
    )
    max_request_mib: int = setting(
        32, flag="--max-request-mib", label="Largest request",
        kind="int", group="server", unit="MiB", minimum=1, maximum=4096,
        help="largest request body accepted; a larger one is refused with 413",
    )
    queue_timeout: float = setting(
        120.0, flag="--queue-timeout", label="Queue timeout",
        kind="float", group="server", unit="s", minimum=0, maximum=86400,
        help="how long a request may wait for a free slot before it is refused with 503 and Retry-After "
        "(0 = wait as long as it takes)",
    )
    max_tokens_policy: str = setting(
        "cap", flag="--max-tokens-policy", label="Longer answers than fit",
        kind="choice", group="server", choices=("cap", "refuse"),
        help="a request whose max_tokens reaches past the context: cap generates up to the context's end and stops "
        "with finish_reason length (agents send max_tokens 32000 whatever the context); refuse answers 400",
    )
    n_predict: int = setting(
        0, flag="--n-predict", label="Most tokens per answer", ui="line",
        kind="int", group="server", unit="tokens", minimum=0, maximum=1 << 24,
        help="most tokens generated for one request, whatever it asks (0 = no limit but the context)",
    )
    chat_template: str = setting(
        "", flag="--chat-template", label="Chat template",
        kind="str", group="model", metavar="FILE|NAME",
        help="a Jinja chat template file, or a built-in name (chatml), instead of the model's own "
        "(empty = the model's own; ChatML where it has none)",
    )
    allow_special_in_content: bool = setting(
        False, flag="--allow-special-in-content", label="Control tokens in messages",
        kind="bool", group="server",
        help="tokenize special-token text inside messages (<|im_end|>, <|im_start|>) as the control tokens, as "
        "llama.cpp and vLLM do; off: message text is text, so a message cannot forge a turn of the template",
    )
    slot_save_path: str | None = setting(
        None, flag="--slot-save-path", label="Slot files folder", ui="folder",
        kind="optional_path", group="server", metavar="DIR",
        help="folder for POST /slots/{id}?action=save|restore session files (unset = slot files disabled)",
    )
    log_level: str = setting(
        "info", flag="--log-level", label="Log level",
        kind="choice", group="server", choices=("debug", "info", "warning", "error"),
        help="log verbosity",
    )
    # -- conversation cache
    conversation_cache_storage: str = setting(
        "ram", flag="--conversation-cache-storage", label="Storage mode",
        kind="choice", group="cache", choices=STORAGE_MODES, live=True,
        help="ram: park in host RAM; disk: park in files, nothing resident; tiered: RAM first, evictions and "
        "shutdown spill to disk",
    )
    conversation_cache_mib: int = setting(
        4096, flag="--conversation-cache-mib", label="RAM budget",
        kind="int", group="cache", unit="MiB", minimum=0, maximum=1 << 24,
        live=True, help="RAM budget for parked conversations (0 = no RAM parking)",
    )
    conversation_cache_disk_mib: int = setting(
        16384, flag="--conversation-cache-disk-mib", label="Disk budget",
        kind="int", group="cache", unit="MiB", minimum=0,
        maximum=1 << 30, live=True, help="disk budget for parked conversations, counting file bytes",
    )
    conversation_cache_write_buffer_mib: int = setting(
        256, flag="--conversation-cache-write-buffer-mib", label="Disk write buffer",
        kind="int", group="cache", unit="MiB", minimum=0,
        maximum=1 << 20, live=True,
        help="RAM for parks and spills not yet written to disk (the most a disk park adds to RSS); when full the "
        "oldest pending spill is dropped, and a disk park larger than this is written before the switch continues",
    )
    conversation_cache_dir: str = setting(
        "", flag="--conversation-cache-dir", label="Folder", ui="folder",
        kind="str", group="cache", live=True, metavar="DIR",
        help="folder for parked conversations (empty = the user cache folder); one subfolder per model",
    )
    conversation_cache_spill_dir: str = setting(
        "", flag="--conversation-cache-spill-dir", label="Spill folder",
        kind="str", group="cache", metavar="DIR",
        help="same as --conversation-cache-storage tiered --conversation-cache-dir DIR",
    )
    conversation_cache_slots: int = setting(
        64, flag="--conversation-cache-slots", label="Most conversations",
        kind="int", group="cache", minimum=1, maximum=100000, live=True,
        help="most conversations parked at once",
    )
    conversation_cache_min_free_mib: int = setting(
        1024, flag="--conversation-cache-min-free-mib", label="Keep free (floor)",
        kind="int", group="cache", unit="MiB", minimum=0,
        maximum=1 << 24, live=True, help="refuse a RAM park that would leave less host memory available than this",
    )
    conversation_cache_days: float = setting(
        30.0, flag="--conversation-cache-days", label="Expiry",
        kind="float", group="cache", unit="days", minimum=0, maximum=36500,
        live=True, help="remove parked files older than this (0 = empty the folder at start)",
    )
    conversation_cache_block_tokens: int = setting(
        64, flag="--conversation-cache-block-tokens", label="Block size",
        kind="int", group="cache", unit="tokens", minimum=16,
        maximum=4096, help="tokens per stored K/V block (blocks are shared between conversations)",
    )
    conversation_cache_checkpoint_tokens: int = setting(
        1024, flag="--conversation-cache-checkpoint-tokens", label="Checkpoint interval", ui="line",
        kind="int", group="cache", unit="tokens", minimum=0, maximum=1 << 20,
        help="hybrid models: keep the recurrent state every this many tokens, prompt or answer (rounded up to a "
        "multiple of the block size) and at every prompt's end, parked with the conversation; a prefix match "
        "resumes from the deepest one (0 = prompt ends only)",
    )
    conversation_cache_n_min: int = setting(
        0, flag="--conversation-cache-n-min", label="Least tokens to restore",
        kind="int", group="cache", unit="tokens", minimum=0, maximum=1 << 24,
        live=True, help="least tokens a hit must offer to be restored (0 = the cost model decides)",
    )
    conversation_cache_similarity: float = setting(
        0.0, flag="--conversation-cache-similarity", label="Least overlap to restore",
        kind="float", group="cache", minimum=0.0, maximum=0.999,
        live=True, help="least fraction of the request a hit must cover to be restored, in [0, 1)",
    )
    conversation_cache_remote: str = setting(
        "", flag="--conversation-cache-remote", label="Remote store", url=True,
        kind="str", group="cache", metavar="URL",
        help="a Redis or Valkey store shared by engines of the same model: parks are written through to it and a "
        "local miss restores from it (redis://[user:password@]host[:port][/db], rediss:// for TLS; empty = none). "
        "Its own maxmemory and eviction policy bound it; entries expire after --conversation-cache-days",
    )
    conversation_cache_remote_allow_network: bool = setting(
        False, flag="--conversation-cache-remote-allow-network", label="Remote store may be on the network",
        kind="bool", group="cache",
        help="allow a --conversation-cache-remote host that is not this machine (parked K/V is the conversation "
        "in another form: prefer rediss:// with a password there)",
    )

    # ------------------------------------------------------------------ construction and validation

    def __post_init__(self) -> None:
        for f in fields(self):
            spec: Setting = f.metadata["setting"]
            object.__setattr__(self, f.name, spec.parse(getattr(self, f.name)))
        if self.conversation_cache_spill_dir:
            # The seeds' spelling: a spill dir means tiered storage in that folder.
            self.conversation_cache_storage = "tiered"
            self.conversation_cache_dir = self.conversation_cache_spill_dir
            self.conversation_cache_spill_dir = ""
        if self.conversation_cache_remote:
            self._check_remote()
        if self.device_draft and not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device_draft):
            raise SettingError(f'{setting_of("device_draft").flag}: unknown device "{self.device_draft}"; expected '
                               "cpu or cuda:N, or empty for the model's first device")
        if self.spec == "draft" and not self.model_draft:
            raise SettingError(f"{setting_of('spec').flag} draft: expected a draft model, but "
                               f"{setting_of('model_draft').flag} is empty; give the draft model's path "
                               "(a GGUF file or Hugging Face folder of the model's vocabulary)")

    def _check_remote(self) -> None:
        flag = setting_of("conversation_cache_remote").flag
        try:
            url = parse_store_url(self.conversation_cache_remote)
        except ValueError as exc:
            raise SettingError(f"{flag}: {exc}") from None
        if self.conversation_cache_storage == "ram" and self.conversation_cache_mib == 0:
            raise SettingError(
                f"{flag}: expected a conversation cache to put it behind, but it is off "
                f"({setting_of('conversation_cache_mib').flag} 0 with RAM storage); give it a RAM budget, or "
                f"{setting_of('conversation_cache_storage').flag} disk"
            )
        if not (url.loopback or self.conversation_cache_remote_allow_network):
            raise SettingError(
                f'{flag}: host "{url.host}" is not this machine, and parked conversations would cross the network; '
                f"expected a loopback host (127.0.0.1, ::1, localhost), or give "
                f"{setting_of('conversation_cache_remote_allow_network').flag} to allow it"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> EngineConfig:
        """Build from {field name or flag: value}; unknown names are refused with the list of known ones."""
        known = {f.name: f for f in fields(cls)}
        by_flag = {f.metadata["setting"].flag.lstrip("-"): f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = key if key in known else by_flag.get(key.lstrip("-"), key.replace("-", "_"))
            if name not in known:
                raise SettingError(f"unknown setting {key!r}; known: {', '.join(sorted(known))}")
            kwargs[name] = value
        return cls(**kwargs)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with `changes` applied and validated."""
        return dataclasses.replace(self, **changes)

    def to_args(self) -> list[str]:
        """The `strata serve` arguments that reproduce this config (defaults left out)."""
        args: list[str] = []
        defaults = EngineConfig()
        for f in fields(self):
            spec: Setting = f.metadata["setting"]
            value = getattr(self, f.name)
            if value == getattr(defaults, f.name) or value is None:
                continue
            args += [spec.flag, _format_value(value)]
        return args

    def public_dict(self) -> dict[str, Any]:
        """Every setting by field name, secrets masked: what GET /cache/config and logs may show."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["setting"].secret and value:
                value = "***"
            elif f.metadata["setting"].url and value:
                value = redact_url(value)
            out[f.name] = value
        return out

    @property
    def cache_dir(self) -> str:
        """The effective parked-conversation folder (before the per-model subfolder)."""
        return self.conversation_cache_dir or default_cache_dir()


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def setting_of(name: str) -> Setting:
    """The declaration of the EngineConfig field `name`."""
    for f in fields(EngineConfig):
        if f.name == name:
            return f.metadata["setting"]
    raise KeyError(name)


def all_settings() -> list[tuple[str, Setting, Any]]:
    """(field name, declaration, default) for every setting, in declaration order."""
    return [(f.name, f.metadata["setting"], f.default) for f in fields(EngineConfig)]


LIVE_SETTINGS = tuple(name for name, spec, _ in all_settings() if spec.live)
