"""A client for an `engine_process` server and a greedy stream run on a thread beside another request (the tests
of restores that must not stall the other slots)."""

from __future__ import annotations

import threading

import openai


def client_for(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.base_url + "/v1", api_key="none", max_retries=0, timeout=300)


def stream_greedy(client: openai.OpenAI, messages: list[dict], max_tokens: int, chunks: list[str],
                  started: threading.Event) -> None:
    """Stream `messages` greedily for exactly `max_tokens`, collecting the text into `chunks`; `started` is set
    once it has produced a few tokens."""
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(chunk.choices[0].delta.content)
            if len(chunks) >= 3:
                started.set()
    started.set()  # also when the stream failed early: the test then fails on its text, not by waiting
