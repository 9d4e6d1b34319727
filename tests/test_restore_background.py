"""A conversation restored from disk is read off the engine thread: on `--parallel 2`, another conversation's
stream keeps producing tokens while the parked one is read and verified, its answer is what it is alone, and a
damaged parked file makes only the restoring conversation a clean miss. Real `strata serve` processes, the
bundled model, real files, the official openai SDK."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import pytest

from tests.engine_process import engine_process
from tests.streams_beside import client_for, stream_greedy

# A large parked conversation (about 1,300 tokens), so its restore reads many block files.
SYSTEM = ("You are a meticulous librarian. You answer in one short sentence. The catalogue lists atlases, "
          "herbariums, ship logs, railway timetables and the letters of a lighthouse keeper. ") * 30
A_FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What do the ship logs record?"}]
B_PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and her cat."}]
B_TOKENS = 96
FLAGS = ("--ctx-size", "2048", "--conversation-cache-storage", "disk", "--conversation-cache-min-free-mib", "0")


def _a_second(a1: str) -> list[dict]:
    return A_FIRST + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And the timetables?"}]


@pytest.fixture(scope="module")
def parked(tmp_path_factory):
    """A folder holding conversation A parked on disk (and nothing else), A's first answer, and B's answer
    alone (the reference its stream beside A's restore must reproduce)."""
    folder = tmp_path_factory.mktemp("parked")
    with engine_process(*FLAGS, "--parallel", "1", "--conversation-cache-dir", str(folder)) as engine:
        client = client_for(engine)
        b = client.chat.completions.create(model="m", messages=B_PROMPT, max_tokens=B_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
        a1 = client.chat.completions.create(model="m", messages=A_FIRST, max_tokens=8, temperature=0)
        with httpx.Client(base_url=engine.base_url, timeout=30) as http:  # B was parked when A took the slot
            for row in http.get("/cache/conversations").json()["conversations"]:
                assert http.delete(f"/cache/conversations/{row['id']}").status_code == 200
        assert engine.stop() == 0, engine.logs()  # a clean shutdown parks A's live slot on disk
    return folder, a1.choices[0].message.content, a1.usage.prompt_tokens, b.choices[0].message.content


def _a_beside_b(folder, a1: str) -> tuple[object, str, dict, str]:
    """On --parallel 2: B streams, and once it produced tokens A's second turn comes back. (A's usage, B's
    text, A's request record, the engine log)."""
    with engine_process(*FLAGS, "--parallel", "2", "--conversation-cache-dir", str(folder)) as engine:
        assert "conversation cache ready: 1 conversations" in engine.logs()
        client = client_for(engine)
        chunks: list[str] = []
        started = threading.Event()
        b = threading.Thread(target=stream_greedy, args=(client, B_PROMPT, B_TOKENS, chunks, started))
        b.start()
        assert started.wait(300)
        a2 = client.chat.completions.create(model="m", messages=_a_second(a1), max_tokens=4, temperature=0)
        b.join(300)
        records = httpx.get(engine.base_url + "/cache/requests", timeout=30).json()["requests"]
        logs = engine.logs()
    a_records = [r for r in records if r["name"].startswith("What do the ship logs")]
    assert len(a_records) == 1, records
    return a2.usage, "".join(chunks), a_records[0], logs


def test_a_disk_restore_runs_while_another_slot_keeps_streaming(parked, tmp_path):
    folder, a1, a1_prompt_tokens, b_alone = parked
    shutil.copytree(folder, tmp_path / "cache")
    usage, b_text, record, logs = _a_beside_b(tmp_path / "cache", a1)

    assert record["source"] == "disk", record
    assert usage.prompt_tokens_details.cached_tokens >= a1_prompt_tokens - 1
    # Between the read's start and the slot joining the batch, B's slot went on producing tokens (with the read
    # on the engine thread it produced none: every slot waited for the files).
    read = record["detail"]["restore_read"]
    assert read["tokens_meanwhile"] >= 1, record
    assert read["ms"] > 0
    assert b_text == b_alone  # B beside the restore computed exactly what it computed alone
    assert "restored" in logs


def test_a_damaged_parked_file_is_a_clean_miss_for_the_restoring_slot_only(parked, tmp_path):
    folder, a1, _, b_alone = parked
    shutil.copytree(folder, tmp_path / "cache")
    blocks = list((tmp_path / "cache").rglob("blk-*.safetensors"))
    assert blocks
    for path in blocks:  # one flipped byte in each block's K/V payload: only the checksum can tell
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    usage, b_text, record, logs = _a_beside_b(tmp_path / "cache", a1)

    assert record["reason"] == "restore_failed", record
    assert record["reused_tokens"] == 0 and usage.prompt_tokens_details.cached_tokens == 0
    assert "damaged" in record["detail"]["error"]
    assert b_text == b_alone
    assert "cannot be restored" in logs


A_TOKENS = [(i * 7) % 200 + 5 for i in range(200)]  # the conversation parked on disk (the tiny engine's)


def _tiny_disk_engine(tmp_path):
    """A tiny random model on the CPU, one slot, conversations parked on disk in blocks of 16 tokens."""
    from engine.config import EngineConfig
    from engine.runtime.engine import Engine
    from tests.model_fixtures import write_tiny_model

    return Engine.from_config(EngineConfig(
        model=write_tiny_model(tmp_path, "llama"), devices="cpu", ctx_size=512, parallel=1,
        conversation_cache_storage="disk", conversation_cache_dir=str(tmp_path / "cache"),
        conversation_cache_min_free_mib=0, conversation_cache_block_tokens=16))


def _last(engine, request_id: str, prompt: list[int]):
    """The last event of a greedy request of 4 tokens."""
    from engine.runtime.requests import GenerationRequest, SamplingParams

    return list(engine.submit(GenerationRequest(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=4))))[-1]


def _park_a(engine) -> None:
    """A_TOKENS answered, then another conversation that takes the one slot: A is parked on disk."""
    for request_id, prompt in (("a", A_TOKENS), ("b", [(i * 13) % 200 + 5 for i in range(200)])):
        last = _last(engine, request_id, prompt)
        assert last.error is None and last.finish_reason == "length", last


@pytest.mark.timeout(120)  # the engine thread used to die here, and the next requests waited for ever
def test_a_request_that_fails_to_start_after_a_disk_restore_fails_alone(tmp_path, monkeypatch):
    """A failure starting a request whose conversation came back from disk (off the engine thread) errors that
    request only, as one on the engine thread's own path does: the engine thread serves on."""
    from engine.runtime.scheduler import Scheduler

    engine = _tiny_disk_engine(tmp_path)

    start = Scheduler._start

    def failing(self, request, *args, **kwargs):
        if request.request_id.startswith("boom"):
            raise RuntimeError("failure starting the request")
        return start(self, request, *args, **kwargs)

    try:
        _park_a(engine)
        monkeypatch.setattr(Scheduler, "_start", failing)
        failed = _last(engine, "boom", [*A_TOKENS, 9, 9])  # a's disk copy, read off the engine thread
        assert failed.finish_reason == "error" and "failure starting the request" in failed.error
        assert engine.call(lambda: engine.slot_set.busy()).result() == 0
        assert _last(engine, "after", [4, 5, 6] * 10).finish_reason == "length"
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_a_restore_that_cannot_be_started_is_a_clean_miss_and_pins_nothing(tmp_path, monkeypatch):
    from engine.runtime.pending_restores import PendingRestores

    engine = _tiny_disk_engine(tmp_path)

    def refuse(*args, **kwargs):
        raise RuntimeError("no reader thread")

    try:
        _park_a(engine)
        monkeypatch.setattr(PendingRestores, "start", refuse)
        again = _last(engine, "again", [*A_TOKENS, 9, 9])  # a's disk copy found, its read not started: prefilled
        assert again.error is None, again.error
        record = engine.call(lambda: engine.stats.requests.snapshot()[-1]).result()
        assert record.reused_tokens == 0 and record.reason == "restore_failed", record
        assert engine.call(lambda: engine.slot_set.busy()).result() == 0
        assert engine.call(lambda: engine.cache.flush()).result()  # b, parked by "again": a purge skips a write
        purged = engine.call(lambda: engine.purge_cache("all")).result()
        assert not purged.get("skipped"), purged  # nothing left pinned by the restore that never began
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_a_conversation_purged_after_its_read_is_not_delivered(tmp_path, monkeypatch):
    """The read was done (its entry no longer pinned) when the purge dropped the conversation: the slot must not
    take what the user asked to forget; the request prefills."""
    import threading

    from engine.cache.restores import RestoreRead

    engine = _tiny_disk_engine(tmp_path)

    read, done_reading, purged = RestoreRead.read, threading.Event(), threading.Event()

    def read_then_wait(self):  # the real read, then held until the purge has run
        read(self)
        done_reading.set()
        purged.wait(30)

    try:
        _park_a(engine)
        assert engine.call(lambda: engine.cache.flush()).result()  # written: a purge skips one being written
        monkeypatch.setattr(RestoreRead, "read", read_then_wait)
        final: list = []
        asking = threading.Thread(target=lambda: final.append(_last(engine, "again", [*A_TOKENS, 9, 9])))
        asking.start()
        assert done_reading.wait(30)
        result = engine.call(lambda: engine.purge_cache("all")).result()
        purged.set()
        asking.join(60)
        assert result["dropped"]["conversations"] >= 1 and final[0].error is None
        record = engine.call(lambda: engine.stats.requests.snapshot()[-1]).result()
        assert record.reused_tokens == 0 and record.reason == "restore_failed", record
        assert "purged or deleted" in record.detail["error"], record.detail
    finally:
        engine.close()


STALLED_READ = """
import threading
from engine.runtime.pending_restores import PendingRestores
from engine.runtime.state import Slot

class Stalled:  # a restore reading from a stalled network disk: its read never returns
    done, error = False, None

    def read(self):
        threading.Event().wait()

restores = PendingRestores(wake=lambda: None)
restores.start(Slot(0), Stalled(), None, 0)
assert len(restores.close(timeout=0.2)) == 1  # given up on: the shutdown does not wait for it
print("closed", flush=True)
"""


def test_a_read_hung_at_shutdown_does_not_keep_the_process_from_exiting():
    """close() gives up on a hung read; the interpreter's exit must not wait for it either (it joins the workers
    of a ThreadPoolExecutor, which the reader was)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", STALLED_READ], capture_output=True, text=True, timeout=30,
                          cwd=str(Path(__file__).resolve().parents[1]))
    assert done.returncode == 0 and done.stdout == "closed\n", done.stderr


def test_a_reader_given_up_on_ends_once_its_hung_call_returns():
    from engine.runtime.reader_thread import ReaderThread

    reader, release = ReaderThread("strata-test-read"), threading.Event()
    hung = reader.submit(release.wait)
    queued = reader.submit(lambda: None)
    assert reader.shutdown(wait=True, timeout=0.2) is False  # given up on
    assert queued.cancelled() and not hung.done()
    release.set()
    assert reader.join(10) and hung.done()  # the stop signal was not lost with the cancelled call
