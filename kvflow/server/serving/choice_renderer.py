"""A generation's choices in the API's shapes: whole responses (`ChoiceRenderer.response`), and the pieces a
streamed chunk shares with them: logprobs, token ids, usage.

With --reasoning-parser each chat choice's text is split into its reasoning and its answer (serving/reasoning.py: the
same state machine whole and streamed, so both cut at the same place); tool calls are parsed from the answer only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from starlette.requests import Request

from kvflow.async_engine import RequestStream
from kvflow.server.common.request_record import current_record
from kvflow.server.serving.generation import Generation, merge, run_unless_disconnected
from kvflow.server.serving.protocol import (ChatCompletionChoice, ChatCompletionResponse, ChatLogprobs,
                                            ChatResponseMessage, CompletionChoice, CompletionLogprobs,
                                            CompletionResponse, CompletionTokensDetails, PromptLogprob,
                                            PromptTokensDetails, TokenLogprob, ToolCall, TopLogprob, UsageInfo)
from kvflow.server.serving.request_metrics import request_metrics
from kvflow.server.serving.reasoning import ReasoningRequest, ReasoningSplitter, reasoning_tokens
from kvflow.server.serving.tool_calls import ExtractedToolCalls, ToolRequest, extract_tool_calls
from kvflow.tokenizer import Tokenizer

Tokens = list[tuple[int, dict[int, float] | None]]     # (token id, its logprobs or None)


@dataclass
class ChoiceResult:
    """A collected choice."""
    text: str = ""
    tokens: Tokens = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def collect_choices(gen: Generation, raw: Request | None) -> list[ChoiceResult]:
    """Every choice whole; raises RequestFailedError if the engine failed the request, an APIError 499 if the
    client went away."""
    results = [ChoiceResult() for _ in range(gen.num_choices)]

    async def gather():
        async for index, d in merge(gen.streams):
            r = results[index]
            r.text += d.text
            r.tokens.extend(zip(d.token_ids, d.logprobs or [None] * len(d.token_ids)))
            if d.finish_reason is not None:
                r.finish_reason, r.stop_reason = d.finish_reason, d.stop_reason

    await run_unless_disconnected(gather(), raw, gen.streams)
    return results


def usage(gen: Generation, before_completion: bool = False) -> UsageInfo:
    """The request's usage so far (`before_completion`: as it stood before any completion token); under
    --reasoning-parser with the reasoning tokens so far."""
    prompt = sum(s.num_prompt_tokens for s in gen.streams)
    completion = 0 if before_completion else sum(s.num_completion_tokens for s in gen.streams)
    cached = sum(s.num_cached_tokens for s in gen.streams)
    details = None
    if gen.reasoning is not None:
        details = CompletionTokensDetails(reasoning_tokens=0 if before_completion
                                          else sum(gen.reasoning_counts.values()))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                     completion_tokens_details=details)


def token_ids(gen: Generation, ids: list[int], s: RequestStream | None = None) -> dict:
    """return_token_ids: a choice's (or chunk's) token ids, and its prompt's when `s` is given."""
    if not gen.return_token_ids:
        return {}
    return {"token_ids": ids, **({"prompt_token_ids": list(s.prompt_token_ids)} if s is not None else {})}


class ChoiceRenderer:
    """Choices, logprobs and whole responses of generations over one tokenizer (tokens shown as its pieces)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def response(self, gen: Generation, results: list[ChoiceResult]) -> ChatCompletionResponse | CompletionResponse:
        """The whole response of a collected generation."""
        head = dict(id=gen.request_id, created=gen.created, model=gen.model)
        if gen.chat:
            choices = [self.chat_choice(gen, i, r) for i, r in enumerate(results)]   # (they count the reasoning)
            first = gen.streams[0]
            if first.params.prompt_logprobs is not None:
                head["prompt_logprobs"] = self.prompt_logprobs(gen, first)
            if gen.return_token_ids:
                head["prompt_token_ids"] = list(first.prompt_token_ids)
            return ChatCompletionResponse(**head, choices=choices, usage=usage(gen), **request_metrics(gen))
        head.update(usage=usage(gen), **request_metrics(gen))
        return CompletionResponse(**head, choices=[self.completion_choice(gen, i, r) for i, r in enumerate(results)])

    def chat_choice(self, gen: Generation, index: int, r: ChoiceResult) -> ChatCompletionChoice:
        """A whole chat choice: its reasoning split off (and counted, for usage), its tool calls parsed out."""
        answer, reasoning = r.text, {}
        if gen.reasoning is not None:       # the answer is what follows the reasoning
            splitter = gen.reasoning.splitter()
            thought, answer = splitter.split(r.text)
            self.count_reasoning(gen, index, splitter, [t for t, _ in r.tokens])
            reasoning = reasoning_fields(gen.reasoning, splitter, thought)
            if splitter.has_reasoning:
                answer = answer or None     # as vLLM: nothing after the reasoning is no content
        echo = gen.echo[0] if gen.echo else ""
        text = echo + answer if answer is not None else (echo or None)
        message, finish = ChatResponseMessage(content=text, **reasoning), r.finish_reason
        if gen.tools is not None:
            found = tool_calls_in(gen.tools, answer or "")
            message = ChatResponseMessage(content=found.content, **reasoning,
                                          tool_calls=[ToolCall(**c) for c in found.tool_calls] or None)
            if found.tool_calls and finish == "stop":
                finish = "tool_calls"
            if (record := current_record()) is not None:
                record.choice_finished(index, finish, [c["function"]["name"] for c in found.tool_calls])
        return ChatCompletionChoice(index=index, message=message, logprobs=self.logprobs(gen, r.tokens)[0],
                                    finish_reason=finish, stop_reason=r.stop_reason,
                                    **token_ids(gen, [t for t, _ in r.tokens]))

    def completion_choice(self, gen: Generation, index: int, r: ChoiceResult) -> CompletionChoice:
        s = gen.stream_of(index)
        echo, prompt_tokens = self.echoed(gen, s)
        return CompletionChoice(
            index=index, text=echo + r.text, logprobs=self.logprobs(gen, prompt_tokens + r.tokens)[0],
            finish_reason=r.finish_reason, stop_reason=r.stop_reason,
            prompt_logprobs=self.prompt_logprobs(gen, s) if s.params.prompt_logprobs is not None else None,
            **token_ids(gen, [t for t, _ in r.tokens], s))

    def echoed(self, gen: Generation, s: RequestStream) -> tuple[str, Tokens]:
        """What a completion choice starts with under echo: the prompt's text and, with logprobs, its tokens with
        their logprobs (the first token has none)."""
        if gen.echo is None:
            return "", []
        text = gen.echo[gen.streams.index(s)]
        if not gen.echoes_logprobs:
            return text, []
        lps = s.prompt_logprobs or [None] * s.num_prompt_tokens
        return text, [(t, None if p is None else {tid: lp for tid, (lp, _rank) in p.items()})
                      for t, p in zip(s.prompt_token_ids, lps)]

    def prompt_logprobs(self, gen: Generation, s: RequestStream) -> list:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
        return [None if p is None else {tid: PromptLogprob(logprob=finite(lp), rank=rank,
                                                           decoded_token=self.token(gen, tid))
                                        for tid, (lp, rank) in p.items()}
                for p in s.prompt_logprobs or []]

    def token(self, gen: Generation, token_id: int) -> str:
        """A token as logprobs show it: its text, or "token_id:N" (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if gen.tokens_as_ids else self.tokenizer.id_to_piece(token_id)

    def logprobs(self, gen: Generation, tokens: Tokens, offset: int = 0):
        """(logprobs of these tokens in the API's format, or None when not asked; the next text offset). A token
        whose logprobs are None (an echoed prompt's first) shows null."""
        top_n = gen.num_logprobs
        if top_n is None:
            return None, offset

        def token(tid: int) -> str:
            return self.token(gen, tid)

        if gen.chat:
            def entry(tid: int, lp: float) -> TopLogprob:
                s = token(tid)
                return TopLogprob(token=s, logprob=finite(lp), bytes=list(s.encode("utf-8")))

            content = []
            for tid, lps in tokens:
                e = entry(tid, lps.get(tid, float("-inf")))
                content.append(TokenLogprob(token=e.token, logprob=e.logprob, bytes=e.bytes,
                                            top_logprobs=[entry(t, lp) for t, lp in top(lps, top_n)]))
            return ChatLogprobs(content=content), offset
        res = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for tid, lps in tokens:
            s = token(tid)
            res.tokens.append(s)
            res.token_logprobs.append(None if lps is None else finite(lps.get(tid, float("-inf"))))
            # as vLLM: the token itself first (the sampled one, or the prompt's under echo), then the top `logprobs`
            # tokens by rank (logprobs=0: the token alone)
            res.top_logprobs.append(None if lps is None else {
                s: finite(lps.get(tid, float("-inf"))), **{token(t): finite(lp) for t, lp in top(lps, len(lps))}})
            res.text_offset.append(offset)
            offset += len(self.tokenizer.id_to_piece(tid))
        return res, offset

    def count_reasoning(self, gen: Generation, index: int, splitter: ReasoningSplitter, ids: list[int]) -> None:
        """A choice's reasoning tokens (of `ids`, its tokens so far), for usage: O(1) while it reasons, a few
        decodes once its reasoning has ended (then the count is final)."""
        skip = gen.stream_of(index).params.skip_special_tokens
        gen.reasoning_counts[index] = reasoning_tokens(splitter, ids, lambda part: self.tokenizer.decode(part, skip))


def tool_calls_in(tools: ToolRequest, text: str) -> ExtractedToolCalls:
    """A finished choice's text -> content and tool calls; text that is no call (cut by max_tokens or a stop
    string) stays content."""
    try:
        return extract_tool_calls(tools, text)
    except json.JSONDecodeError:
        return ExtractedToolCalls(text or None)


def reasoning_fields(request: ReasoningRequest, splitter: ReasoningSplitter, thought: str) -> dict:
    """A whole choice's `reasoning` and `reasoning_content` (vLLM sends both): None where the output had no
    reasoning, an empty one, or include_reasoning is false."""
    if not splitter.has_reasoning or not request.include_reasoning or not thought:
        return {}      # as a stream, which sends no reasoning then
    return {"reasoning": thought, "reasoning_content": thought}


def top(lps: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(lps.items(), key=lambda kv: -kv[1])[:n]


def finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number
    return max(float(x), -9999.0)
