"""/metrics in Prometheus text format: derived from the JSON body, and parseable by Prometheus' own parser."""

from __future__ import annotations

from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from engine.contract import MetricsBody
from engine.figures import CacheFigures, EngineFigures, Timing, counter
from engine.server.prometheus import render_prometheus

STATS = MetricsBody(
    engine=EngineFigures(
        model="SmolLM2-135M-Instruct", state="running", slots=4, slots_busy=1, queued=0,
        requests=12, prompt_tokens=3400, cached_tokens=1200, generated_tokens=560,
        prefill_tokens_per_s=310.5, decode_tokens_per_s=41.2, uptime_s=12.5, pid=4242, devices=["cpu"],
        expert_arena_bytes=7 << 30,
    ),
    conversation_cache=CacheFigures(
        enabled=True, storage="tiered", hits=3, misses=1, tokens_reused=5000, bytes_ram=1024, ram_bytes=4096,
        park_ms=Timing(last=1.5, p50=1.2, p95=2.0), refusals={"min_free": 2}, prefill_tokens_per_s=None,
    ),
)


@dataclass(frozen=True, slots=True)
class _WithReasons(EngineFigures):
    """A figure added the documented way: one line declares a labelled counter."""

    prefill_reasons: dict[str, int] = counter(label="reason", metric="prefill_reason")


def _samples(body: MetricsBody = STATS) -> dict[str, tuple[str, float, dict]]:
    text = render_prometheus(body).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sample.labels.items() if family.type == "counter")
            out[key] = (family.type, sample.value, sample.labels)
    return out


def test_numbers_become_gauges_and_totals_become_counters():
    samples = _samples()
    assert samples["strata_engine_slots_busy"][:2] == ("gauge", 1.0)
    assert samples["strata_engine_decode_tokens_per_s"][:2] == ("gauge", 41.2)
    assert samples["strata_engine_prompt_tokens_total"][:2] == ("counter", 3400.0)
    assert samples["strata_conversation_cache_hits_total"][:2] == ("counter", 3.0)


def test_nested_objects_join_keys_and_booleans_are_zero_or_one():
    samples = _samples()
    assert samples["strata_conversation_cache_bytes_ram"][1] == 1024.0
    assert samples["strata_conversation_cache_park_ms_p50"][1] == 1.2
    assert samples["strata_conversation_cache_refusals_min_free"][:2] == ("gauge", 2.0)
    assert samples["strata_conversation_cache_enabled"][1] == 1.0
    assert "strata_conversation_cache_prefill_tokens_per_s" not in samples  # null: nothing measured yet
    assert not any(name.startswith("strata_engine_devices") for name in samples)  # lists are left out


def test_a_labelled_counter_is_one_family_with_a_sample_per_key():
    body = replace(STATS, engine=_WithReasons(**{f: getattr(STATS.engine, f) for f in ("model", "state")},
                                              prefill_reasons={"diverged": 2, "cold": 5}))
    samples = _samples(body)
    assert samples["strata_prefill_reason_total{reason=cold}"][:2] == ("counter", 5.0)
    assert samples["strata_prefill_reason_total{reason=diverged}"][:2] == ("counter", 2.0)


def test_the_expert_arena_goes_by_its_own_name():
    samples = _samples()
    assert samples["strata_expert_arena_bytes"][:2] == ("gauge", float(7 << 30))
    assert "strata_engine_expert_arena_bytes" not in samples


def test_text_fields_are_labels_of_an_info_gauge():
    samples = _samples()
    assert samples["strata_engine_info"][1:] == (1.0, {"int4_kernel": "", "kv_dtype": "",
                                                      "model": "SmolLM2-135M-Instruct", "omp_wait_policy": "",
                                                      "state": "running", "weights_format": ""})
    assert samples["strata_conversation_cache_info"][2] == {"dir": "", "storage": "tiered", "remote": "",
                                                            "remote_state": ""}


def test_a_condition_is_a_zero_or_one_gauge_with_its_text_as_a_label():
    assert _samples()["strata_disk_error"] == ("gauge", 0.0, {"reason": ""})
    error = "ENOSPC (No space left on device): writing conversation 0123 failed at 2025-05-01T12:00:00Z"
    body = replace(STATS, conversation_cache=replace(STATS.conversation_cache, disk_error=error))
    assert _samples(body)["strata_disk_error"] == ("gauge", 1.0, {"reason": error})
    assert "disk_error" not in _samples(body)["strata_conversation_cache_info"][2]  # not a label of the info too


def test_each_render_is_independent():
    first = render_prometheus(STATS)
    assert render_prometheus(STATS) == first
    assert b"strata_engine_requests_total 12.0" in first
