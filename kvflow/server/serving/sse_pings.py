"""Keep-alive for Server-Sent Events (`--sse-ping-interval`, llama-server's flag): while a stream has nothing to
send (a long prefill before its first token, a wait in the queue, a long gap between tokens) it sends an SSE comment,
`: ping`, every interval, so that a client or a proxy with a read timeout sees a live connection. Every SSE parser
skips comment lines (the `openai` and `anthropic` clients included), so the stream's events are unchanged."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

PING = ": ping\n\n"
DEFAULT_SSE_PING_INTERVAL = 30.0      # llama-server's default (seconds)


async def with_pings(events: AsyncIterator[str], interval: float | None) -> AsyncIterator[str]:
    """`events` as they come, and PING after each `interval` seconds without one (None or <= 0: no pings). The
    next event is awaited in one task across pings, so a ping never cancels the work that produces it."""
    if interval is None or interval <= 0:
        async for event in events:
            yield event
        return
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield PING
                continue
            task, pending = pending, None
            try:
                event = task.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
