"""A generation streamed: its chat or completion chunks as the engine produces them (`stream_chunks`), and the
Server-Sent Events that carry them (`sse_events`, `EventStream`).

Each choice keeps its own state in one `StreamedChoice`: its tool calls parsed so far, where its reasoning ends,
its tokens while their reasoning count may change, its completion text offset. A chunk's logprobs, token ids and
usage come out as in a whole response (choice_renderer.py).

Beam search (`use_beam_search`) streams too: each prompt's stream yields its n beams whole, best first, once the
search is done, so a streamed chat gets each beam's text in one chunk, as vLLM's (completions refuse stream).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from kvflow.async_engine import CompletionDelta, RequestFailedError, RequestStream
from kvflow.server.common.errors import APIError
from kvflow.server.common.request_record import current_record
from kvflow.server.serving.choice_renderer import ChoiceRenderer, token_ids, usage
from kvflow.server.serving.generation import Generation, merge
from kvflow.server.serving.protocol import (ChatCompletionChunk, ChatCompletionStreamChoice, CompletionChoice,
                                            CompletionChunk, DeltaMessage, PromptProgressInfo, UsageInfo)
from kvflow.server.serving.request_metrics import request_metrics
from kvflow.server.serving.sse_pings import with_pings
from kvflow.server.serving.reasoning import ReasoningRequest, ReasoningSplitter
from kvflow.server.serving.tool_calls import ToolCallStreamer


@dataclass
class StreamedChoice:
    """One choice of a streamed generation: what its next chunks depend on."""
    index: int
    tool_calls: ToolCallStreamer | None = None    # chat with tools: its text so far, the calls announced
    reasoning: ReasoningSplitter | None = None    # --reasoning-parser: whether its reasoning has ended
    # its tokens so far, kept while its reasoning count may change (usage's reasoning_tokens)
    token_ids: list[int] = field(default_factory=list)
    reasoning_counted: bool = False               # its reasoning count is final (the reasoning ended, or none)
    opened: bool = False                          # completions: its first chunk (echo, prompt ids) went out
    text_offset: int = 0                          # completions' logprobs: the text_offset of its next token


async def stream_chunks(gen: Generation, renderer: ChoiceRenderer
                        ) -> AsyncIterator[ChatCompletionChunk | CompletionChunk]:
    """The stream's chunks as the engine produces them (to serialize with exclude_unset); raises
    RequestFailedError if the engine fails the request. The caller closes the streams."""
    choices = [StreamedChoice(i, tool_calls=ToolCallStreamer(gen.tools) if gen.tools is not None else None,
                              reasoning=gen.reasoning.splitter() if gen.reasoning is not None else None)
               for i in range(gen.num_choices)]

    def running_usage(opening: bool = False) -> UsageInfo | None:
        """continuous_usage_stats: usage on every chunk, as vLLM sends it; the chunks that open the stream count
        no completion tokens (they go out before any, whatever the engine has produced meanwhile)."""
        return usage(gen, before_completion=opening) if gen.continuous_usage else None

    if gen.chat:
        for i in range(gen.n):
            first = {"prompt_token_ids": list(gen.streams[0].prompt_token_ids)} if (
                gen.return_token_ids and i == 0) else {}
            yield chunk(gen, [ChatCompletionStreamChoice(
                index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None)],
                running_usage(opening=True), **first)
        for i in range(gen.n if gen.echo else 0):
            yield chunk(gen, [ChatCompletionStreamChoice(
                index=i, delta=DeltaMessage(content=gen.echo[0]), logprobs=None, finish_reason=None)],
                running_usage(opening=True))
    async for index, d in merge(gen.streams):
        if d.prompt_progress is not None and gen.return_progress:     # llama-server's: a chunk without choices
            yield chunk(gen, [], running_usage(opening=True),
                        prompt_progress=PromptProgressInfo(**dataclasses.asdict(d.prompt_progress)))
            if not d.token_ids and not d.text and d.finish_reason is None:
                continue
        choice = choices[index]
        tokens = list(zip(d.token_ids, d.logprobs or [None] * len(d.token_ids)))
        wants_logprobs = gen.num_logprobs is not None and bool(d.token_ids)
        opening = {}
        if gen.chat:
            deltas, finish = chat_deltas(d, choice.tool_calls, choice.reasoning, gen.reasoning)
            splitter = choice.reasoning
            if splitter is not None and not choice.reasoning_counted:    # counted as it goes (continuous usage)
                choice.token_ids += d.token_ids
                renderer.count_reasoning(gen, index, splitter, choice.token_ids)
                if finish is not None or splitter.reasoning_end is not None or not splitter.has_reasoning:
                    choice.reasoning_counted = True
            if finish is not None and choice.tool_calls is not None and (record := current_record()) is not None:
                record.choice_finished(index, finish, choice.tool_calls.names)
        else:
            text, prompt_tokens = "", []
            if not choice.opened:      # the choice's first chunk: the echo, its prompt's ids
                choice.opened = True
                text, prompt_tokens = renderer.echoed(gen, gen.stream_of(index))
                opening = token_ids(gen, [], gen.stream_of(index))
            tokens = prompt_tokens + tokens
            text += d.text
            deltas, finish = ([text] if text else []), d.finish_reason
            wants_logprobs = wants_logprobs or bool(prompt_tokens)
        # a token whose text the detokenizer holds back (an incomplete UTF-8 sequence) still sends its id
        sends_ids = gen.return_token_ids and bool(d.token_ids)
        if not deltas and finish is None and not wants_logprobs and not opening and not sends_ids:
            continue
        logprobs, choice.text_offset = renderer.logprobs(gen, tokens, choice.text_offset)
        deltas = deltas or [empty_delta(choice) if gen.chat else ""]
        for j, delta in enumerate(deltas):    # logprobs and token ids on the first chunk, the finish on the last
            last = j == len(deltas) - 1
            end = {"finish_reason": finish if last else None}
            if last and finish is not None:
                end["stop_reason"] = d.stop_reason
            lp = logprobs if j == 0 else None
            ids = {**opening, **token_ids(gen, list(d.token_ids))} if j == 0 else {}
            if gen.chat:
                streamed = ChatCompletionStreamChoice(index=index, delta=delta, logprobs=lp, **end, **ids)
            else:
                streamed = CompletionChoice(index=index, text=delta, logprobs=lp, **end, **ids)
            yield chunk(gen, [streamed], running_usage())
    if gen.include_usage:      # vLLM's per-request metrics ride on the usage chunk (none without it)
        yield chunk(gen, [], usage(gen), **request_metrics(gen))


def empty_delta(choice: StreamedChoice) -> DeltaMessage:
    """The delta of a chat chunk that carries no text (the finish after a stop token, logprobs of a held-back
    token), as vLLM sends it: `content: ""` when nothing parses the text (vLLM sends each step's text as content,
    empty or not; a client that concatenates delta.content relies on it), `{}` when a tool-call parser or a
    reasoning parser had nothing to say."""
    return DeltaMessage() if choice.tool_calls is not None or choice.reasoning is not None else DeltaMessage(content="")


def chunk(gen: Generation, choices: list, usage: UsageInfo | None = None, **fields):
    """One chunk; `usage` is present (null until the end, unless continuous) only when asked for."""
    cls = ChatCompletionChunk if gen.chat else CompletionChunk
    extra = {"usage": usage} if gen.include_usage else {}
    return cls(id=gen.request_id, object=cls.model_fields["object"].default, created=gen.created,
               model=gen.model, system_fingerprint=None, choices=choices, **extra, **fields)


def chat_deltas(d: CompletionDelta, streamer: ToolCallStreamer | None, splitter: ReasoningSplitter | None = None,
                reasoning: ReasoningRequest | None = None) -> tuple[list[DeltaMessage], str | None]:
    """One engine delta -> the chat deltas to send (reasoning, then content or tool-call chunks) and the finish
    reason. `splitter`: the choice's reasoning splitter (--reasoning-parser); only the answer reaches `streamer`."""
    finish = d.finish_reason
    thought, answer = splitter.push(d.text) if splitter is not None and d.text else ("", d.text)
    if splitter is not None and finish is not None:
        rest = splitter.finish()
        thought, answer = thought + rest[0], answer + rest[1]
    deltas = [DeltaMessage(reasoning=thought, reasoning_content=thought)] if (
        thought and reasoning is not None and reasoning.include_reasoning) else []
    if streamer is None:
        return deltas + ([DeltaMessage(content=answer)] if answer else []), finish
    parts = streamer.push(answer) if answer else []
    if finish is not None:
        parts += streamer.finish()
        if finish == "stop" and streamer.has_tool_calls:
            finish = "tool_calls"
    return deltas + [DeltaMessage(**p) for p in parts], finish


async def sse_events(chunks: AsyncIterator[ChatCompletionChunk | CompletionChunk], streams: list[RequestStream],
                     failure: Callable[[RequestFailedError], APIError]) -> AsyncIterator[str]:
    """Server-Sent Events: the chunks as the engine produces them, an error event (`failure`'s body) if it fails,
    then [DONE]."""
    try:
        async for body in chunks:
            yield f"data: {body.model_dump_json(exclude_unset=True)}\n\n"
    except RequestFailedError as e:
        err = failure(e)
        if (record := current_record()) is not None:
            record.fail_in_stream(err)
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        for s in streams:
            s.close()
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """SSE response that closes (aborts) its request streams however it ends, even if never iterated; with
    `ping_interval`, an SSE comment whenever it has had nothing to send for that long (sse_pings.py)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream],
                 ping_interval: float | None = None) -> None:
        super().__init__(with_pings(content, ping_interval), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.close()
