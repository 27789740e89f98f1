"""One accepted chat or completion request, `Generation`: its engine streams and how its choices are shown; and
reading those streams (`merge`, `run_unless_disconnected`), whole or streamed.

Chat and completions differ in how a request becomes prompt token ids and in the shape of a choice; from
`Generation` on they share one path: collected whole (choice_renderer.py) or streamed as SSE chunks
(chunk_stream.py), with the same logprobs, usage and error handling.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from starlette.requests import Request

from kvflow.async_engine import CompletionDelta, RequestStream
from kvflow.server.common.errors import APIError
from kvflow.server.serving.reasoning import ReasoningRequest
from kvflow.server.serving.tool_calls import ToolRequest


@dataclass
class Generation:
    """One accepted request: its engine streams (one per prompt, each with n choices) and how to show them."""
    request_id: str
    model: str
    chat: bool
    streams: list[RequestStream]
    num_logprobs: int | None           # top log-probabilities per token; None: no logprobs
    include_usage: bool = False
    continuous_usage: bool = False
    tools: ToolRequest | None = None   # chat with tools that may be called: parse calls out of the text
    created: int = field(default_factory=lambda: int(time.time()))
    # per prompt, the text each of its choices starts with (completions' echo: the prompt; chat's echo: the last
    # message, when it is the assistant's); None: no echo
    echo: list[str] | None = None
    return_token_ids: bool = False
    tokens_as_ids: bool = False        # logprobs' tokens as "token_id:N"
    reasoning: ReasoningRequest | None = None   # chat under --reasoning-parser: split each choice's text
    # per choice, its reasoning tokens so far (usage's completion_tokens_details)
    reasoning_counts: dict[int, int] = field(default_factory=dict)
    return_progress: bool = False      # a stream's prompt_progress chunks (llama-server's)
    per_request_metrics: bool = False  # --enable-per-request-metrics: the response's `metrics` (request_metrics.py)

    @property
    def n(self) -> int:
        return self.streams[0].params.n

    @property
    def num_choices(self) -> int:
        """Every prompt's n choices: choice k*n + i is prompt k's i-th."""
        return len(self.streams) * self.n

    def stream_of(self, index: int) -> RequestStream:
        """The engine stream (prompt) of choice `index`."""
        return self.streams[index // self.n]

    @property
    def echoes_logprobs(self) -> bool:
        """Completions' echo with logprobs: the echoed prompt's tokens carry their logprobs too."""
        return self.echo is not None and not self.chat and self.num_logprobs is not None


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, CompletionDelta]]:
    """Interleave the streams of a request as (choice index, delta); choice k*n + i is stream k's i-th."""
    n = streams[0].params.n
    if len(streams) == 1:
        async for d in streams[0]:
            yield d.index, d
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, s: RequestStream):
        try:
            async for d in s:
                await queue.put((k, d))
        except BaseException as e:  # noqa: BLE001
            await queue.put((k, e))
            return
        await queue.put((k, done))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            k, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k * n + item.index, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def run_unless_disconnected(coro, raw: Request | None, streams: list[RequestStream]):
    """Await `coro`; if the HTTP client disconnects first, cancel it (which aborts the streams)."""
    if raw is None:
        return await coro
    task = asyncio.ensure_future(coro)

    async def wait_disconnect():
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        for s in streams:
            s.close()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    for s in streams:
        s.close()
    with contextlib.suppress(BaseException):
        await task
    raise APIError(499, "client disconnected", type="client_closed_request")
