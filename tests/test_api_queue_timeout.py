"""Issue 19.4: --queue-timeout. A request that no slot takes within the timeout fails fast with a 503, a
Retry-After header and OpenAI's error shape, streaming or not, instead of hanging behind a long generation."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import openai

from tests.engine_process import engine_process
from tests.model_fixtures import write_tiny_model


@contextlib.contextmanager
def holding_the_slot(base_url: str, ctx: int) -> Iterator[openai.Stream]:
    """A streamed generation of ~`ctx` tokens that holds the only slot, its events read in a thread as they come: a
    client that stops reading is cancelled once its backlog is full (the last test here), which would free the slot
    within a few thousand tokens, a second or two for the tiny model. Closing the stream ends it."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.completions.create(model="m", prompt="a long story", max_tokens=ctx - 100, stream=True,
                                       extra_body={"ignore_eos": True})
    events = iter(stream)
    next(events)  # it holds the only slot now

    def read() -> None:
        with contextlib.suppress(Exception):  # the stream closed under it
            for _ in events:
                pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield stream
    finally:
        stream.close()
        reader.join(timeout=10)


def test_a_request_queued_past_the_timeout_gets_503_with_retry_after(tmp_path):
    # The long generation must outlast the three refused requests (~3 s): the tiny model decodes a token in well
    # under a millisecond on the native CPU step, so it is given a context of 64K tokens to fill.
    ctx = 65536
    model = write_tiny_model(tmp_path, "llama", max_position_embeddings=ctx)
    with (engine_process("--model", model, "--ctx-size", str(ctx), "--parallel", "1", "--queue-timeout", "1",
                         "--conversation-cache-mib", "0") as proc,
          holding_the_slot(proc.base_url, ctx) as long_one):
        body = {"prompt": "me next", "max_tokens": 2}
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            for stream in (False, True):
                r = http.post("/v1/completions", json={**body, "stream": stream})
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"].isdigit() and int(r.headers["retry-after"]) >= 1
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == 503
                assert "--queue-timeout" in err["message"] and err["type"] == "unavailable_error"
            assert http.get("/slots").json()[0]["state"] == "busy"  # the long one still ran meanwhile
            with openai.OpenAI(base_url=proc.base_url + "/v1", api_key="none", max_retries=0, timeout=60) as sdk:
                try:
                    sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                    raise AssertionError("expected a 503")
                except openai.InternalServerError as exc:
                    assert exc.status_code == 503
            long_one.close()  # the slot frees; a queued request is served again
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        assert proc.alive()


def test_a_queued_request_whose_client_left_leaves_the_queue_at_once(tmp_path):
    ctx = 65536
    model = write_tiny_model(tmp_path, "llama", max_position_embeddings=ctx)
    with (engine_process("--model", model, "--ctx-size", str(ctx), "--parallel", "1", "--queue-timeout", "60",
                         "--conversation-cache-mib", "0") as proc,
          holding_the_slot(proc.base_url, ctx)):
        with (httpx.Client(base_url=proc.base_url, timeout=1.0) as impatient,
              contextlib.suppress(httpx.ReadTimeout)):
            impatient.post("/v1/completions", json={"prompt": "me next", "max_tokens": 2})
        deadline = time.monotonic() + 10
        while proc.get_json("/metrics")[1]["engine"]["queued"] != 0:
            assert time.monotonic() < deadline, "the request of a client that left stayed queued"
            time.sleep(0.1)
        assert proc.get_json("/slots")[1][0]["state"] == "busy", "while the long one still runs"


def test_a_client_that_stops_reading_its_stream_has_its_request_cancelled(tmp_path):
    import json
    import socket
    from urllib.parse import urlsplit

    ctx = 65536
    model = write_tiny_model(tmp_path, "llama", max_position_embeddings=ctx)
    with engine_process("--model", model, "--ctx-size", str(ctx), "--parallel", "1",
                        "--conversation-cache-mib", "0") as proc:
        url = urlsplit(proc.base_url)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((url.hostname, url.port))
        body = json.dumps({"prompt": "a long story", "max_tokens": ctx - 100, "stream": True,
                           "ignore_eos": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        sock.recv(1024)  # it started; from here on nothing is read
        deadline = time.monotonic() + 60
        while "stopped reading, request cancelled" not in proc.logs():
            assert time.monotonic() < deadline, "generation went on into buffers for a client that stopped reading"
            time.sleep(0.2)
        while proc.get_json("/slots")[1][0]["state"] != "idle":
            assert time.monotonic() < deadline, "the slot stayed busy"
            time.sleep(0.1)
        generated = proc.get_json("/metrics")[1]["engine"]["generated_tokens"]
        sock.close()
    assert generated < ctx // 2, generated
