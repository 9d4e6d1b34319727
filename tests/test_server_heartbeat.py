"""A stream that stays silent (a long prefill) gets a heartbeat, so clients and proxies keep it open; events pass
through unchanged and in order, and closing the stream early cancels the step it waits on."""

from __future__ import annotations

import asyncio

from engine.runtime.requests import TokenEvent
from engine.server.streaming import with_heartbeat


async def _slow_events(delays: list[float]):
    for i, delay in enumerate(delays):
        await asyncio.sleep(delay)
        yield TokenEvent(text=str(i))


def test_silence_becomes_heartbeats_and_events_pass_in_order():
    async def run():
        return [e if e is None else e.text async for e in with_heartbeat(_slow_events([0.0, 0.35, 0.0]), 0.1)]

    got = asyncio.run(run())
    assert [e for e in got if e is not None] == ["0", "1", "2"]
    beats = got.index("1") - got.index("0") - 1
    assert 2 <= beats <= 4, got


def test_closing_early_cancels_the_pending_step():
    cancelled = asyncio.Event()

    async def stuck():
        try:
            yield TokenEvent(text="a")
            await asyncio.sleep(60)
            yield TokenEvent(text="never")
        finally:
            cancelled.set()

    async def run():
        beat = with_heartbeat(stuck(), 0.05)
        assert (await beat.__anext__()).text == "a"
        assert await beat.__anext__() is None
        await beat.aclose()
        await asyncio.wait_for(cancelled.wait(), 2)

    asyncio.run(run())
