"""The seeds' own scenario on a GPU: a K-quant mixture-of-experts GGUF served with its routed experts in host RAM
(`--moe-experts cpu`) beside the rest of the model on CUDA. It starts (its warm-up runs the experts on the CPU in
float32 beside the GPU's bfloat16), answers through the server, and parks and restores a conversation. Skipped
without a CUDA device."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.engine_process import engine_process
from tests.moe_fixtures import write_tiny_moe_gguf

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(600)]

SIZES = {"hidden_size": 256, "moe_intermediate_size": 256}  # Q4_K blocks span 256 values of a row
ASK = "Tell me about the river that runs through the old town, and the bridges over it."


def _chat(http: httpx.Client, text: str) -> dict:
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": text}],
                                                 "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_0"])
def test_a_k_quant_moe_serves_with_its_experts_in_host_ram_beside_cuda(tmp_path, qtype):
    path = write_tiny_moe_gguf(tmp_path, "qwen3_moe", expert_types=dict.fromkeys(("gate", "up", "down"), qtype),
                               **SIZES)
    with engine_process("--model", path, "--devices", "cuda:0", "--moe-experts", "cpu", "--parallel", "1",
                        "--ctx-size", "512", timeout=300) as engine, \
            httpx.Client(base_url=engine.base_url, timeout=120) as http:
        first = _chat(http, ASK)
        assert first["usage"]["completion_tokens"] == 16
        _chat(http, "Something else entirely, a second conversation about cooking.")  # parks the first
        again = _chat(http, ASK)
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "restored, not prefilled again"
        assert "index_add_" not in engine.logs()
