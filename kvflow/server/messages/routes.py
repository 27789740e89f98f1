"""/v1/messages: Anthropic's Messages API (as vLLM and llama-server serve it for coding agents), a thin adapter over
the chat route with no engine path of its own.

A Messages request becomes one `ChatCompletionRequest`: `system` -> a system message first, text blocks -> text,
an assistant's tool_use blocks -> its `tool_calls`, tool_result blocks -> tool messages, consecutive turns of one
role -> one turn (as Anthropic combines them), a final assistant turn -> a prefill the reply continues,
`stop_sequences` -> `stop`, `tools` -> function tools, `tool_choice` any -> "required" and tool -> a named function,
`output_config.format` -> `response_format`, `thinking` enabled -> `thinking_token_budget`.
`OpenAIServing.start_chat` submits it, and the reply is read back
through the chat route's own `collect` + `renderer.chat_choice` (whole) or `chunks` (streamed): prompts, sampling,
structured outputs, tool-call parsing, reasoning (--reasoning-parser: a `thinking` block first), usage and metrics are
the chat route's. This module renders Anthropic's shapes: content blocks, stop reasons, usage, the SSE event sequence the `anthropic` client's parser reads, and
errors as `{"type": "error", "error": {"type", "message"}}`, whatever raised them (`MessagesRoute`).

/v1/messages/count_tokens takes the same body (max_tokens optional) down the same path, `chat_request` then the
chat route's `prepare_chat`, and answers with the size of the prompt it built, submitting nothing: the count is the
prompt /v1/messages runs for that body, tools, system and template included.

The field rule, as on the other routes: each field of Anthropic's request is implemented (a field of the models
below) or refused with a 400 naming its path (request_fields.MESSAGES_REFUSED); a field nobody defines is ignored
and logged once. Refused fields land in a model's `model_extra` (extra="allow") until `check` reads them, so
that the 400 can name the whole path (`messages[0].content[1].citations`).
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from kvflow.async_engine import RequestFailedError
from kvflow.errors import InvalidRequestError
from kvflow.server.common.errors import APIError
from kvflow.server.serving.choice_renderer import usage as chat_usage
from kvflow.server.serving.chunk_stream import EventStream
from kvflow.server.serving.generation import Generation
from kvflow.server.serving.protocol import ChatCompletionRequest, ChatResponseMessage
from kvflow.server.serving.request_fields import MESSAGES_FIELDS, messages_refused
from kvflow.server.serving.serving import OpenAIServing
from kvflow.server.messages.protocol import (COUNT_TOKENS_PATH, ContentBlockDeltaEvent, ContentBlockStartEvent,
                                             ContentBlockStopEvent, ContentOut, CountTokensRequest,
                                             CountTokensResponse, InputJsonDelta, InputMessage, MESSAGES_PATH,
                                             MessageDeltaEvent, MessageStartEvent, MessageStopEvent,
                                             MessagesErrorDetail, MessagesErrorResponse, MessagesPart,
                                             MessagesRequest, MessagesResponse, MessagesUsage, PingEvent, ServerTool,
                                             SignatureDelta, StopDelta, StopReason, StreamEvent, TextBlock,
                                             TextContent, TextDelta, ThinkingBlock, ThinkingContent, ThinkingDelta,
                                             ToolResultBlock,
                                             ToolUseBlock, ToolUseContent, UnsupportedBlock, sse)

logger = logging.getLogger("kvflow.server")
_UNKNOWN_LOGGED: set[str] = set()       # "kind.name" of fields nobody defines, already logged (once each)

# ---- errors -----------------------------------------------------------------------------------------------------
# Anthropic's error types by HTTP status (its API reference); 503 (the engine died, or is shutting down): "try again
# later", Anthropic's overloaded_error
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}

# the chat path's names for a field -> the Messages API's (its 400s name the field as the client sent it)
_PARAM_NAMES = ((re.compile(r"stop(?=$|\[)"), "stop_sequences"),
                (re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
                (re.compile(r"tools\[(\d+)\]\.function\.name"), r"tools[\1].name"),
                (re.compile(r"tools\[(\d+)\]\.function"), r"tools[\1]"),
                (re.compile(r"response_format(\.json_schema)?"), "output_config.format"),
                (re.compile(r"parallel_tool_calls$"), "tool_choice.disable_parallel_tool_use"),
                (re.compile(r"user$"), "metadata.user_id"),
                (re.compile(r"max_completion_tokens$"), "max_tokens"),
                (re.compile(r"thinking_token_budget$"), "thinking.budget_tokens"),
                (re.compile(r"(prompt|continue_final_message|add_generation_prompt|chat_template)$"), "messages"))


def messages_param(param: str | None) -> str | None:
    """A field as the chat path names it -> as the Messages request spells it."""
    if param is None:
        return None
    for pattern, name in _PARAM_NAMES:
        if pattern.match(param):
            return pattern.sub(name, param, count=1)
    return param


def error_body(err: APIError) -> dict:
    """An error in Anthropic's shape; the message starts with the field's path when there is one."""
    param = messages_param(err.param)
    message = err.message if not param or err.message.startswith(f"{param}: ") else f"{param}: {err.message}"
    kind = ERROR_TYPES.get(err.status_code, "api_error" if err.status_code >= 500 else "invalid_request_error")
    return MessagesErrorResponse(error=MessagesErrorDetail(type=kind, message=message)).model_dump()


def as_api_error(exc: Exception) -> APIError:
    """Whatever a request on this route raised, as an APIError (its status and message)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError.bad_request(exc)
    if isinstance(exc, (RequestValidationError, ValidationError)):
        return APIError(400, validation_message(exc.errors()))
    if isinstance(exc, HTTPException):     # the body limit's 413 (raised while the body is read), 404, 405
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers)
    logger.exception("internal error on %s", MESSAGES_PATH)     # a bug of ours, never a bad request
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="internal_error")


def validation_message(errors) -> str:
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
    located = [(error_path(e.get("loc", ())), e.get("msg")) for e in errors]
    # a union reports every branch: the deepest locations are the branch the input took (a list of blocks, not
    # the string it also could have been)
    deepest = [(p, m) for p, m in located if not any(q.startswith((f"{p}.", f"{p}[")) for q, _ in located)]
    msgs = [f"{p}: {m}" if p else str(m) for p, m in deepest[:5]]
    return "; ".join(msgs) or "invalid request"


_UNION_BRANCHES = {"TextBlock", "ToolUseBlock", "ToolResultBlock", "ThinkingBlock", "UnsupportedBlock", "MessagesTool",
                   "ServerTool"}


def error_path(loc) -> str:
    """pydantic's location -> the field's path as the request spells it: messages[0].content[1].text."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in ("body", "str", "int", "float", "bool") and part not in _UNION_BRANCHES \
                and not part.startswith(("list[", "dict[", "function-", "tagged-union[", "literal[")):
            path += f".{part}" if path else part
    return path


class MessagesRoute(APIRoute):
    """A route that answers every error in Anthropic's shape: its handler (which parses and validates the body, then
    runs the endpoint) is wrapped, so the app's handlers, which answer in OpenAI's shape, never see them."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def handle(request: Request):
            try:
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 -- converted, never swallowed: as_api_error logs our own bugs
                err = as_api_error(exc)
                return JSONResponse(error_body(err), status_code=err.status_code, headers=err.headers)
        return handle


# ---- request -> chat request ------------------------------------------------------------------------------------
def check(part: MessagesPart | None, path: str) -> None:
    """The field rule for one part: a 400 naming the first refused field's path; fields nobody defines are logged
    once. Then the part's own cache_control."""
    if part is None:
        return
    extra = part.model_extra or {}
    name = messages_refused(part.KIND, extra)
    if name is not None:
        where = f"{path}.{name}" if path else name
        raise APIError(400, "not supported by kvflow: leave it unset (or at its default)", param=where)
    for name in set(extra) - set(MESSAGES_FIELDS.get(part.KIND, ())):
        key = f"{part.KIND}.{name}"
        if key not in _UNKNOWN_LOGGED:
            _UNKNOWN_LOGGED.add(key)
            logger.warning("ignoring the Messages request field %r (in %s): Anthropic does not define it", name,
                           path or "the request")
    check(getattr(part, "cache_control", None), f"{path}.cache_control" if path else "cache_control")


def unsupported(block: UnsupportedBlock, path: str) -> APIError:
    return APIError(400, f"content blocks of type {block.type!r} are not supported by kvflow: text, tool_use "
                         f"(assistant) and tool_result (user) are", param=path)


def text_of(blocks: list, path: str) -> list[str]:
    """The texts of a list of text blocks (system, a tool result's content)."""
    texts = []
    for k, block in enumerate(blocks):
        where = f"{path}[{k}]"
        if isinstance(block, UnsupportedBlock):
            raise unsupported(block, where)
        check(block, where)
        texts.append(block.text)
    return texts


def tool_result_text(block: ToolResultBlock, path: str) -> str:
    text = block.content if isinstance(block.content, str) else "\n".join(text_of(block.content, f"{path}.content"))
    # a chat template has no field for a failed call: the model reads it from the text
    return f"Error: {text}" if block.is_error else text


def turns(message: InputMessage, path: str) -> list[dict]:
    """One Anthropic message -> chat turns ({"role", "parts", "tool_calls", "thinking"} or a tool message), in block
    order."""
    if isinstance(message.content, str):
        return [{"role": message.role, "parts": [message.content], "tool_calls": [], "thinking": []}]
    out: list[dict] = []

    def current() -> dict:
        if not out or out[-1]["role"] != message.role:
            out.append({"role": message.role, "parts": [], "tool_calls": [], "thinking": []})
        return out[-1]

    for j, block in enumerate(message.content):
        where = f"{path}.content[{j}]"
        if isinstance(block, UnsupportedBlock):
            raise unsupported(block, where)
        check(block, where)
        if isinstance(block, TextBlock):
            current()["parts"].append(block.text)
        elif isinstance(block, ThinkingBlock):
            if message.role != "assistant":
                raise APIError(400, "thinking blocks belong in assistant messages", param=where)
            current()["thinking"].append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise APIError(400, "tool_use blocks belong in assistant messages", param=where)
            current()["tool_calls"].append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:
            if message.role != "user":
                raise APIError(400, "tool_result blocks belong in user messages", param=where)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": tool_result_text(block, where)})
    return out


def chat_messages(req: MessagesRequest) -> list[dict]:
    """The conversation as the chat route's messages. Consecutive user (or assistant) turns are one turn, as
    Anthropic combines them; a turn's text blocks are its content parts (the chat route joins them with "\\n")."""
    merged: list[dict] = []
    if req.system is not None:
        system = [req.system] if isinstance(req.system, str) else text_of(req.system, "system")
        merged.append({"role": "system", "parts": system, "tool_calls": [], "thinking": []})
    for i, message in enumerate(req.messages):
        check(message, f"messages[{i}]")
        for turn in turns(message, f"messages[{i}]"):
            last = merged[-1] if merged else None
            if last is not None and turn["role"] in ("user", "assistant") and last["role"] == turn["role"]:
                last["parts"] += turn["parts"]
                last["tool_calls"] += turn["tool_calls"]
                last["thinking"] += turn["thinking"]
            else:
                merged.append(turn)
    out = []
    for m in merged:
        if m["role"] == "tool":
            out.append(m)
            continue
        msg: dict[str, Any] = {"role": m["role"],
                               "content": [{"type": "text", "text": t} for t in m["parts"]] or None}
        if m["tool_calls"]:
            msg["tool_calls"] = m["tool_calls"]
        if m["thinking"]:        # an earlier reply's thinking: the assistant message's reasoning (vLLM joins them so)
            msg["reasoning"] = "".join(m["thinking"])
        out.append(msg)
    return out


def chat_tools(req: MessagesRequest) -> dict[str, Any]:
    """tools / tool_choice / parallel_tool_calls as the chat route takes them (parse_tool_request checks the rest)."""
    out: dict[str, Any] = {}
    choice = req.tool_choice
    check(choice, "tool_choice")
    forced = choice is not None and choice.type in ("any", "tool", "none")      # the grammar decides, or no call
    if req.tools is not None:
        out["tools"] = []
        for i, tool in enumerate(req.tools):
            where = f"tools[{i}]"
            if isinstance(tool, ServerTool):
                raise APIError(400, f"Anthropic's server tool {tool.type!r} is not built into kvflow: give client "
                                    "tools (name, description, input_schema)", param=f"{where}.type")
            check(tool, where)
            if tool.input_schema.get("type", "object") != "object":
                raise APIError(400, "a tool's input is an object: input_schema.type must be \"object\"",
                               param=f"{where}.input_schema.type")
            if tool.strict and not forced:
                raise APIError(400, "strict input needs tool_choice any, tool or none (the grammar enforces the "
                                    "schema); under auto the model writes its calls freely", param=f"{where}.strict")
            function = {"name": tool.name, "parameters": {"type": "object", **tool.input_schema}}
            if tool.description is not None:
                function["description"] = tool.description
            out["tools"].append({"type": "function", "function": function})
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice of type \"tool\" names the tool", param="tool_choice.name")
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            if choice.type == "auto":     # refused here whether or not the server parses "auto" calls at all
                raise APIError(400, "one tool call at most is enforced under tool_choice any or tool (by the "
                                    "grammar), not under auto", param="tool_choice.disable_parallel_tool_use")
            out["parallel_tool_calls"] = False
    return out


def thinking_budget(thinking: dict | None) -> int | None:
    """Anthropic's `thinking` as the chat route's thinking_token_budget: enabled -> its budget_tokens (the engine
    forces the end of the thinking there; Anthropic's floor of 1024 is not kept: a small model thinks less), disabled
    -> none; adaptive, which would switch a model's thinking on, is a 400 naming it."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    allowed = {"enabled": ("type", "budget_tokens"), "disabled": ("type",)}.get(kind)
    if allowed is None:
        raise APIError(400, f"{kind!r} is not supported by kvflow: enabled (with budget_tokens) or disabled "
                            "(kvflow cannot switch a model's thinking on: that is its chat template's)",
                       param="thinking.type")
    extra = next((k for k in thinking if k not in allowed), None)
    if extra is not None:
        raise APIError(400, "not supported by kvflow: leave it unset", param=f"thinking.{extra}")
    if kind == "disabled":
        return None
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise APIError(400, f"must be an integer >= 0, got {budget!r}", param="thinking.budget_tokens")
    return budget


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The Messages request as the chat route's request (a 400 naming the Messages field for what kvflow refuses)."""
    check(req, "")
    check(req.metadata, "metadata")
    response_format = None
    if req.output_config is not None:
        check(req.output_config, "output_config")
        if req.output_config.format is not None:
            check(req.output_config.format, "output_config.format")
            response_format = {"type": "json_schema",
                               "json_schema": {"name": "output", "schema": req.output_config.format.json_schema}}
    messages = chat_messages(req)
    budget = thinking_budget(req.thinking)
    # a final assistant turn is a prefill: the reply continues it (and does not repeat it)
    prefill = req.messages[-1].role == "assistant"
    body = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens, "stop": req.stop_sequences,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stream": req.stream,
            "response_format": response_format, "user": req.metadata.user_id if req.metadata else None,
            "request_id": uuid.uuid4().hex, "continue_final_message": prefill, "add_generation_prompt": not prefill,
            "chat_template_kwargs": req.chat_template_kwargs, "thinking_token_budget": budget, **chat_tools(req)}
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


# ---- chat results -> Anthropic's shapes -------------------------------------------------------------------------
def stop_reason(finish_reason: str | None, stop: int | str | None) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stop, str):      # a stop string, not the EOS (None) or a stop token id
        return "stop_sequence", stop
    return "end_turn", None


def signature() -> str:
    """A thinking block's signature: random, as vLLM's (kvflow signs nothing)."""
    return uuid.uuid4().hex


def content_blocks(message: ChatResponseMessage) -> list[ContentOut]:
    blocks: list[ContentOut] = [ThinkingContent(thinking=message.reasoning, signature=signature())] if (
        message.reasoning) else []
    blocks += [TextContent(text=message.content)] if message.content else []
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)     # the tool-call parser's own JSON
        if isinstance(arguments, dict):
            blocks.append(ToolUseContent(id=call.id, name=call.function.name, input=arguments))
        else:    # "auto" lets the model write any arguments; a tool's input is an object: keep the call as text
            blocks.append(TextContent(text=json.dumps({"name": call.function.name, "arguments": arguments})))
    return blocks


def usage(gen: Generation) -> MessagesUsage:
    u = chat_usage(gen)
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return MessagesUsage(input_tokens=u.prompt_tokens - cached, output_tokens=u.completion_tokens,
                         cache_creation_input_tokens=0, cache_read_input_tokens=cached)


class StreamedBlocks:
    """The chat route's deltas -> content block events: a thinking block while reasoning comes (its signature
    before it stops), a text block while text comes, a tool_use block per call (its input as the JSON text the model
    writes). Each block is started, filled and stopped before the next (the
    chat stream sends no text between or after calls); `index` is the block's place in the content."""

    def __init__(self) -> None:
        self.index = 0                          # of the open block, or of the next one
        self.open: str | None = None            # the open block's type
        self.call_blocks: dict[int, int] = {}   # tool call index -> its block's index

    def start(self, block: ContentOut) -> list[StreamEvent]:
        events = self.stop()
        self.open = block.type
        return events + [ContentBlockStartEvent(index=self.index, content_block=block)]

    def stop(self) -> list[StreamEvent]:
        if self.open is None:
            return []
        events: list[StreamEvent] = []
        if self.open == "thinking":
            events.append(ContentBlockDeltaEvent(index=self.index, delta=SignatureDelta(signature=signature())))
        self.open = None
        self.index += 1
        return events + [ContentBlockStopEvent(index=self.index - 1)]

    def push(self, delta) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if delta.reasoning:
            if self.open != "thinking":
                events += self.start(ThinkingContent(thinking="", signature=""))
            events.append(ContentBlockDeltaEvent(index=self.index, delta=ThinkingDelta(thinking=delta.reasoning)))
        if delta.content:
            if self.open != "text":
                events += self.start(TextContent(text=""))
            events.append(ContentBlockDeltaEvent(index=self.index, delta=TextDelta(text=delta.content)))
        for call in delta.tool_calls or []:
            if "id" in call:                # a call starts: {"index", "id", "type", "function": {"name", ...}}
                events += self.start(ToolUseContent(id=call["id"], name=call["function"]["name"], input={}))
                self.call_blocks[call["index"]] = self.index
            fragment = (call.get("function") or {}).get("arguments")
            if fragment:
                events.append(ContentBlockDeltaEvent(index=self.call_blocks[call["index"]],
                                                     delta=InputJsonDelta(partial_json=fragment)))
        return events


class MessagesAPI:
    """POST /v1/messages and /v1/messages/count_tokens over OpenAIServing's chat path."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: MessagesRequest, raw: Request | None = None):
        chat = chat_request(req)
        gen = await self.serving.start_chat(chat, raw)
        message_id = f"msg_{chat.request_id}"
        if req.stream:
            return EventStream(self.events(gen, message_id), gen.streams, self.serving.sse_ping_interval)
        result = (await self.serving.collect(gen, raw))[0]
        choice = self.serving.renderer.chat_choice(gen, 0, result)
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
        return MessagesResponse(id=message_id, model=gen.model, content=content_blocks(choice.message),
                                stop_reason=reason, stop_sequence=sequence, usage=usage(gen))

    async def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        """The size of the prompt /v1/messages would run for the same body: the request goes the same way
        (chat_request, then the chat route's prepare_chat: template, tools, checks) and stops short of the engine."""
        if req.stream:
            raise APIError(400, "count_tokens streams nothing: leave stream unset", param="stream")
        prepared = await self.serving.preparer.prepare_chat(chat_request(req))
        return CountTokensResponse(input_tokens=len(prepared.prompt_ids[0]))

    async def events(self, gen: Generation, message_id: str) -> AsyncIterator[str]:
        """The stream: message_start (the prompt's size), ping, the content blocks as the chat route streams them,
        message_delta (stop reason, usage), message_stop; an `error` event if the engine fails the request."""
        start = MessagesResponse(id=message_id, model=gen.model, content=[],
                                 usage=MessagesUsage(input_tokens=gen.streams[0].num_prompt_tokens, output_tokens=0))
        yield sse(MessageStartEvent(message=start))
        yield sse(PingEvent())
        blocks = StreamedBlocks()
        finish = stop = None
        try:
            async for chunk in self.serving.chunks(gen):
                for choice in chunk.choices:
                    for event in blocks.push(choice.delta):
                        yield sse(event)
                    if choice.finish_reason is not None:
                        finish, stop = choice.finish_reason, choice.stop_reason
            for event in blocks.stop():
                yield sse(event)
            reason, sequence = stop_reason(finish, stop)
            yield sse(MessageDeltaEvent(delta=StopDelta(stop_reason=reason, stop_sequence=sequence), usage=usage(gen)))
            yield sse(MessageStopEvent())
        except RequestFailedError as e:
            yield sse(MessagesErrorResponse.model_validate(error_body(self.serving.failure(e))))
        finally:
            for s in gen.streams:
                s.close()


OPENAPI_RESPONSES = {
    200: {"model": MessagesResponse,
          "description": "the message, or with `stream: true` Server-Sent Events from `message_start` to "
                         "`message_stop` (or an `error` event)",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **{status: {"model": MessagesErrorResponse, "description": description} for status, description in (
        (400, "invalid request (the message starts with the field's path)"), (401, "missing or wrong API key"),
        (404, "unknown model"), (413, "request body larger than --max-request-body-size"),
        (429, "queue full (--max-queue-len): retry after Retry-After seconds"),
        (500, "the engine failed on this request"), (503, "the engine died or the server is shutting down"))}}


def messages_router(serving: OpenAIServing) -> APIRouter:
    """The /v1/messages route, for the app to include (its errors in Anthropic's shape: MessagesRoute)."""
    api = MessagesAPI(serving)
    router = APIRouter(route_class=MessagesRoute)

    # `beta`: Anthropic's clients (Claude Code) add ?beta=true when they use a beta feature; the features are
    # implemented or refused field by field, so the flag changes nothing here
    @router.post(MESSAGES_PATH, response_model=None, responses=OPENAPI_RESPONSES)
    async def create_message(req: MessagesRequest, raw: Request, beta: bool | None = None):
        return await api.create(req, raw)

    @router.post(COUNT_TOKENS_PATH, response_model=CountTokensResponse,
                 responses={k: v for k, v in OPENAPI_RESPONSES.items() if k not in (200, 429, 500)})
    async def count_tokens(req: CountTokensRequest, beta: bool | None = None):
        return await api.count_tokens(req)

    return router
