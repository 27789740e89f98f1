"""/v1/responses: OpenAI's Responses API as a thin adapter over the chat route (no engine path of its own).

A Responses request becomes one `ChatCompletionRequest` (instructions -> a system message first, input items ->
messages, `text.format` -> `response_format`, function tools -> chat tools and `tool_choice`, `max_output_tokens` ->
`max_tokens`), submitted through `OpenAIServing.start_chat`; the answer is read back through the chat route's own
`collect` + `renderer.chat_choice` (whole) or `chunks` (streamed), so prompts, sampling, structured outputs, tool-call
parsing, reasoning (--reasoning-parser: a `reasoning` item before the message), usage, errors and metrics are the chat
route's. This module only renders the Responses shapes: output items
and the typed event sequence openai-python's stream parser expects. A 400 from the chat path names the field as
the Responses API spells it (`max_output_tokens`, `input`, `text.format`, `tools[0].name`).
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter
from pydantic import ValidationError
from starlette.requests import Request

from kvflow.async_engine import RequestFailedError
from kvflow.errors import InvalidRequestError
from kvflow.server.common.errors import GENERATE_ERRORS, APIError
from kvflow.server.serving.protocol import ChatCompletionChoice, ChatCompletionRequest, ChatLogprobs, UsageInfo
from kvflow.server.responses.protocol import (INCLUDE_LOGPROBS, IncompleteDetails, InputTokensDetails,
                                              ResponseContentPartEvent, ResponseError,
                                              ResponseFunctionCallArgumentsDeltaEvent,
                                              ResponseFunctionCallArgumentsDoneEvent, ResponseFunctionToolCall,
                                              ResponseLifecycleEvent, ResponseOutputItemEvent, ResponseOutputMessage,
                                              ResponseOutputText, ResponseReasoningItem,
                                              ResponseReasoningTextDeltaEvent, ResponseReasoningTextDoneEvent,
                                              ResponsesRequest, ResponsesResponse, ResponseStreamEvent,
                                              ResponseTextDeltaEvent, ResponseTextDoneEvent, ResponseTokenLogprob,
                                              ResponseUsage, OutputTokensDetails, ReasoningText, response_id)
from kvflow.server.serving.choice_renderer import usage as chat_usage
from kvflow.server.serving.chunk_stream import EventStream
from kvflow.server.serving.generation import Generation
from kvflow.server.serving.serving import OpenAIServing

# the OpenAPI document's 200 for the route (its errors are the chat route's)
RESPONSES_OPENAPI = {200: {"model": ResponsesResponse,
                           "description": "the response object, or with `stream: true` Server-Sent Events from "
                                          "`response.created` to `response.completed` (or `.incomplete` / `.failed`)",
                           "content": {"text/event-stream": {"schema": {"type": "string"}}}}}

# input message roles -> the chat template's: OpenAI's "developer" is the system-level role of newer models, and
# chat templates know it as "system"
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}   # part type -> its text's key
FUNCTION_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")
# the chat route's name for a field (as a prefix of a 400's param) -> the Responses API's
PARAM_NAMES = (("response_format.json_schema.schema", "text.format.schema"),
               ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
               ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
               ("messages", "input"), ("prompt", "input"), ("reasoning_effort", "reasoning.effort"))
_TOOL_FUNCTION_PARAM = re.compile(r"^(tools\[\d+\])\.function\b")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: ResponsesRequest, raw: Request | None = None):
        rid = req.request_id or response_id()
        gen = await self.start(req, rid, raw)
        head = response_head(req, rid, gen)
        if req.stream:
            return EventStream(self.events(gen, head, req.include_logprobs), gen.streams,
                               self.serving.sse_ping_interval)
        results = await self.serving.collect(gen, raw)
        choice = self.serving.renderer.chat_choice(gen, 0, results[0])
        incomplete = choice.finish_reason == "length"
        return head.model_copy(update=dict(
            status="incomplete" if incomplete else "completed", completed_at=int(time.time()),
            incomplete_details=IncompleteDetails() if incomplete else None,
            output=output_items(choice, req.include_logprobs), usage=response_usage(chat_usage(gen))))

    async def start(self, req: ResponsesRequest, rid: str, raw: Request | None) -> Generation:
        """The chat request submitted; a 400 from anywhere on the way names the Responses API's field."""
        try:
            chat = ChatCompletionRequest.model_validate(chat_request_body(req, rid))
            return await self.serving.start_chat(chat, raw)
        except APIError as e:
            e.param = responses_param(e.param)
            raise
        except InvalidRequestError as e:
            err = APIError.bad_request(e)
            err.param = responses_param(err.param)
            raise err from None
        except ValidationError as e:        # a message that is no valid chat message (e.g. a lone surrogate)
            first = e.errors()[0]
            param = responses_param(".".join(str(x) for x in first["loc"][:1])) or None
            raise APIError(400, f"{param or 'input'}: {first['msg']}", param=param) from None

    async def events(self, gen: Generation, head: ResponsesResponse, include_logprobs: bool) -> AsyncIterator[str]:
        """The typed event stream, from the chat route's chunks; a request the engine fails ends with
        `response.failed`. The engine streams are closed however it ends."""
        writer = ResponseEventWriter(head, include_logprobs)
        finish = None
        try:
            for e in writer.start():
                yield e
            async for chunk in self.serving.chunks(gen):
                for choice in chunk.choices:
                    d = choice.delta
                    for e in writer.reasoning(d.reasoning or ""):
                        yield e
                    logprobs = token_logprobs(choice.logprobs) if include_logprobs else []
                    for e in writer.text(d.content or "", logprobs):
                        yield e
                    for call in d.tool_calls or []:
                        for e in writer.tool_call(call):
                            yield e
                    if choice.finish_reason is not None:
                        finish = choice.finish_reason
            for e in writer.finish(finish, response_usage(chat_usage(gen))):
                yield e
        except RequestFailedError as err:
            yield writer.fail(self.serving.failure(err).message)
        finally:
            for s in gen.streams:
                s.close()


# ---- Responses request -> chat request --------------------------------------------------------------------------
def chat_request_body(req: ResponsesRequest, rid: str) -> dict[str, Any]:
    """The ChatCompletionRequest body a Responses request means; APIError 400 naming the Responses field for what
    has no chat equivalent here."""
    if req.include_logprobs and req.tools:
        raise APIError(400, f"{INCLUDE_LOGPROBS} is not supported together with tools: function calls carry no "
                            "logprobs in the Responses API", param="include")
    for value in req.include or ():
        if value != INCLUDE_LOGPROBS:
            raise APIError(400, f"include {value!r} is not supported: kvflow only adds {INCLUDE_LOGPROBS!r}",
                           param="include")
    if req.top_logprobs and not req.include_logprobs:
        raise APIError(400, f"top_logprobs needs include [{INCLUDE_LOGPROBS!r}]", param="top_logprobs")
    body: dict[str, Any] = {
        "model": req.model, "messages": input_messages(req), "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream, "user": req.user,
        "response_format": response_format(req.text), "reasoning_effort": reasoning_effort(req.reasoning),
        "request_id": rid, "top_k": req.top_k, "logit_bias": req.logit_bias,
        "repetition_penalty": req.repetition_penalty, "seed": req.seed, "stop": req.stop, "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens, "include_stop_str_in_output": req.include_stop_str_in_output,
        "structured_outputs": req.structured_outputs,
    }
    if req.include_logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    if req.tools:
        body.update(tools=chat_tools(req.tools, req.tool_choice), tool_choice=chat_tool_choice(req.tool_choice),
                    parallel_tool_calls=req.parallel_tool_calls)
    elif req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)   # the chat route's 400 unless "none"
    return {k: v for k, v in body.items() if v is not None}


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """instructions and input -> chat messages: message items as messages, function_call items as the assistant's
    tool_calls (joined onto the assistant message they follow), function_call_output items as tool messages, reasoning
    items (an earlier response's, passed back) as the reasoning of the assistant message they open."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    if not req.input:
        raise APIError(400, "input must not be empty", param="input")
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise APIError(400, f"unknown role {role!r}: expected one of {', '.join(ROLES)}", param=f"{where}.role")
            content = text_parts(item.get("content"), f"{where}.content")
            last = messages[-1] if messages else None
            if role == "assistant" and last is not None and last.get("opened_by_reasoning"):
                del last["opened_by_reasoning"]
                last["content"] = content          # the message the reasoning led to
            else:
                messages.append({"role": ROLES[role], "content": content})
        elif kind == "function_call":
            call = {"id": required_str(item, "call_id", where), "type": "function",
                    "function": {"name": required_str(item, "name", where),
                                 "arguments": required_str(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.pop("opened_by_reasoning", None)
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            messages.append({"role": "assistant", "content": None, "reasoning": reasoning_text(item, where),
                             "opened_by_reasoning": True})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": required_str(item, "call_id", where),
                             "content": text_parts(item.get("output"), f"{where}.output")})
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported: give messages, function_call, "
                                "function_call_output and reasoning items (kvflow keeps no items to reference)",
                           param=f"{where}.type")
    for m in messages:
        m.pop("opened_by_reasoning", None)
    return messages


def reasoning_text(item: dict, where: str) -> str:
    """A reasoning input item's text: its reasoning_text parts (kvflow's own reasoning items carry them). A summary
    alone or encrypted content (OpenAI's) gives kvflow no text to put before the answer: a 400."""
    if item.get("encrypted_content") is not None:
        raise APIError(400, "encrypted reasoning is not supported: kvflow encrypts none (pass its reasoning items "
                            "back as they came)", param=f"{where}.encrypted_content")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise APIError(400, "a reasoning item passed back needs its reasoning_text content", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
            raise APIError(400, "reasoning content parts are {'type': 'reasoning_text', 'text': ...}",
                           param=f"{where}.content[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def text_parts(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content: a string, or its text parts as chat content parts (joined as the chat route joins
    them); any other part (images, files, audio) is a 400 naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        key = TEXT_PARTS.get(part.get("type")) if isinstance(part, dict) else None
        if key is None or not isinstance(part.get(key), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise APIError(400, f"content part of type {kind!r} is not supported: only text parts "
                                f"({', '.join(TEXT_PARTS)}) are", param=f"{where}[{j}].type")
        parts.append({"type": "text", "text": part[key]})
    return parts


def required_str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{key} must be a string", param=f"{where}.{key}")
    return value


def chat_tools(tools: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]]:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) -> chat tools. Built-in tools
    are a 400: kvflow runs none. `strict` passes to the chat route, which treats it as vLLM's does: the grammar
    enforces the parameters where tool_choice forces the calls ("required" or a named function); under "auto" the
    model writes its calls freely and they are parsed as written, strict or not, as on /v1/chat/completions (the
    OpenAI Agents SDK marks every function tool strict, under "auto" too)."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools of type {tool.get('type')!r} are not supported: only function tools (kvflow "
                                "runs no built-in tools)", param=f"tools[{i}].type")
        for key, value in tool.items():
            if key not in FUNCTION_TOOL_KEYS and value not in (None, False, [], {}):
                raise APIError(400, f"{key} is not supported on a function tool", param=f"tools[{i}].{key}")
        out.append({"type": "function", "function": {k: tool[k] for k in FUNCTION_TOOL_KEYS[1:]
                                                     if tool.get(k) is not None}})
    return out


def chat_tool_choice(tool_choice: Any) -> Any:
    """"none" | "auto" | "required" pass as they are; {"type": "function", "name"} -> the chat form."""
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice
    if tool_choice.get("type") == "function" and isinstance(tool_choice.get("name"), str):
        return {"type": "function", "function": {"name": tool_choice["name"]}}
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}: "
                        "allowed_tools and built-in tools are not supported", param="tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format -> the chat route's response_format (the same structured-output path)."""
    if not text:
        return None
    for key, value in text.items():
        if key != "format" and value is not None:
            raise APIError(400, f"text.{key} is not supported by kvflow: leave it unset", param=f"text.{key}")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format needs a JSON schema object as `schema`", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "description", "strict")
                                                       if fmt.get(k) is not None}}
    raise APIError(400, f"text.format type {kind!r} is not supported: expected 'text', 'json_object' or "
                        "'json_schema'", param="text.format.type")


def reasoning_effort(reasoning: dict[str, Any] | None) -> str | None:
    """reasoning.effort reaches the chat template as `reasoning_effort` (a 400 if the template never reads it);
    kvflow's reasoning items hold the reasoning itself (--reasoning-parser), never a summary."""
    for key, value in (reasoning or {}).items():
        if key != "effort" and value is not None:
            raise APIError(400, f"reasoning.{key} is not supported: kvflow writes no reasoning summaries",
                           param=f"reasoning.{key}")
    return (reasoning or {}).get("effort")


def responses_param(param: str | None) -> str | None:
    """A 400's param as the chat path names it -> as the Responses request names it."""
    if param is None:
        return None
    param = _TOOL_FUNCTION_PARAM.sub(r"\1", param)       # tools[i].function.name -> tools[i].name
    for chat, responses in PARAM_NAMES:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return responses + param[len(chat):]
    return param


# ---- chat results -> Responses shapes ---------------------------------------------------------------------------
def response_head(req: ResponsesRequest, rid: str, gen: Generation) -> ResponsesResponse:
    """The response object before any output: the request's settings echoed, as OpenAI does."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return ResponsesResponse(
        id=rid, created_at=gen.created, status="in_progress", model=gen.model, instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_logprobs=req.top_logprobs, text={"format": fmt},
        tools=req.tools or [], tool_choice=req.tool_choice or "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False, reasoning=req.reasoning,
        metadata=req.metadata, user=req.user)


def output_items(choice: ChatCompletionChoice, include_logprobs: bool) -> list:
    """A finished chat choice -> output items: its reasoning (--reasoning-parser), its text as a message (also when
    empty and nothing was called), then one function_call item per tool call."""
    message, items = choice.message, []
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    if message.reasoning:
        items.append(ResponseReasoningItem(id=item_id("rs"), content=[ReasoningText(text=message.reasoning)],
                                           status="completed" if message.content or message.tool_calls else status))
    calls = message.tool_calls or []
    if message.content or not calls:
        logprobs = token_logprobs(choice.logprobs) if include_logprobs else None
        items.append(ResponseOutputMessage(
            id=item_id("msg"), status="incomplete" if choice.finish_reason == "length" else "completed",
            content=[ResponseOutputText(text=message.content or "", logprobs=logprobs)]))
    items += [ResponseFunctionToolCall(id=item_id("fc"), call_id=c.id, name=c.function.name,
                                       arguments=c.function.arguments, status="completed") for c in calls]
    return items


def token_logprobs(logprobs: ChatLogprobs | None) -> list[ResponseTokenLogprob]:
    return [ResponseTokenLogprob.model_validate(t.model_dump()) for t in (logprobs.content or [])] if logprobs else []


def response_usage(u: UsageInfo) -> ResponseUsage:
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    reasoning = u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details else 0
    return ResponseUsage(input_tokens=u.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens=u.completion_tokens, total_tokens=u.total_tokens,
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning))


class ResponseEventWriter:
    """One streamed response's events, in the order openai-python's parser checks: created, in_progress; per output
    item added -> (content part added -> text deltas -> text done -> part done | argument deltas -> arguments done)
    -> item done; then completed (incomplete when max_output_tokens cut it, failed when the engine failed it).
    A reasoning item (added -> reasoning_text part added -> reasoning_text deltas -> done -> part done -> item done)
    comes first, when the chat route streams reasoning.
    One item is open at a time: reasoning before text, text before calls (the chat route's tool-call streamer sends no prose after a
    call), and each call opens when the streamer announces it."""

    def __init__(self, head: ResponsesResponse, include_logprobs: bool) -> None:
        self.head = head
        self.include_logprobs = include_logprobs
        self.items: list = []                 # closed items, in output order
        self.sequence = 0
        self.message: ResponseOutputMessage | None = None
        self.text_so_far: list[str] = []
        self.logprobs: list[ResponseTokenLogprob] = []
        self.call: ResponseFunctionToolCall | None = None
        self.arguments: list[str] = []
        self.thought: ResponseReasoningItem | None = None     # the open reasoning item
        self.thought_so_far: list[str] = []

    def sse(self, event: ResponseStreamEvent) -> str:
        event.sequence_number = self.sequence
        self.sequence += 1
        return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"

    @property
    def output_index(self) -> int:            # of the open item
        return len(self.items)

    def start(self) -> list[str]:
        return [self.sse(ResponseLifecycleEvent(type=t, response=self.head))
                for t in ("response.created", "response.in_progress")]

    def reasoning(self, delta: str) -> list[str]:
        if not delta:
            return []
        out = []
        if self.thought is None:
            self.thought = ResponseReasoningItem(id=item_id("rs"), content=[], status="in_progress")
            out += [self.sse(ResponseOutputItemEvent(type="response.output_item.added",
                                                     output_index=self.output_index, item=self.thought)),
                    self.sse(ResponseContentPartEvent(type="response.content_part.added", item_id=self.thought.id,
                                                      output_index=self.output_index, part=ReasoningText(text="")))]
        self.thought_so_far.append(delta)
        out.append(self.sse(ResponseReasoningTextDeltaEvent(item_id=self.thought.id, output_index=self.output_index,
                                                            delta=delta)))
        return out

    def close_reasoning(self, status: str) -> list[str]:
        if self.thought is None:
            return []
        text, index = "".join(self.thought_so_far), self.output_index
        part = ReasoningText(text=text)
        item = self.thought.model_copy(update={"content": [part], "status": status})
        out = [self.sse(ResponseReasoningTextDoneEvent(item_id=item.id, output_index=index, text=text)),
               self.sse(ResponseContentPartEvent(type="response.content_part.done", item_id=item.id,
                                                 output_index=index, part=part)),
               self.sse(ResponseOutputItemEvent(type="response.output_item.done", output_index=index, item=item))]
        self.items.append(item)
        self.thought, self.thought_so_far = None, []
        return out

    def text(self, delta: str, logprobs: list[ResponseTokenLogprob]) -> list[str]:
        # logprobs of tokens whose text is still held back (a possible stop string) go out with the done event
        self.logprobs += logprobs
        if not delta:
            return []
        out = self.close_reasoning("completed")
        out += self.open_message() if self.message is None else []
        self.text_so_far.append(delta)
        out.append(self.sse(ResponseTextDeltaEvent(item_id=self.message.id, output_index=self.output_index,
                                                   delta=delta, logprobs=logprobs)))
        return out

    def open_message(self) -> list[str]:
        self.message = ResponseOutputMessage(id=item_id("msg"), status="in_progress", content=[])
        part = ResponseOutputText(text="", logprobs=[] if self.include_logprobs else None)
        return [self.sse(ResponseOutputItemEvent(type="response.output_item.added", output_index=self.output_index,
                                                 item=self.message)),
                self.sse(ResponseContentPartEvent(type="response.content_part.added", item_id=self.message.id,
                                                  output_index=self.output_index, part=part))]

    def close_message(self, status: str) -> list[str]:
        if self.message is None:
            return []
        text, index = "".join(self.text_so_far), self.output_index
        part = ResponseOutputText(text=text, logprobs=self.logprobs if self.include_logprobs else None)
        item = ResponseOutputMessage(id=self.message.id, status=status, content=[part])
        out = [self.sse(ResponseTextDoneEvent(item_id=item.id, output_index=index, text=text, logprobs=self.logprobs)),
               self.sse(ResponseContentPartEvent(type="response.content_part.done", item_id=item.id,
                                                 output_index=index, part=part)),
               self.sse(ResponseOutputItemEvent(type="response.output_item.done", output_index=index, item=item))]
        self.items.append(item)
        self.message, self.text_so_far, self.logprobs = None, [], []
        return out

    def tool_call(self, delta: dict[str, Any]) -> list[str]:
        """A chat tool-call delta: the first names the call (with its id), the rest carry argument fragments."""
        out = []
        function = delta.get("function") or {}
        if delta.get("id") is not None:
            out += self.close_reasoning("completed") + self.close_message("completed") + self.close_call("completed")
            self.call = ResponseFunctionToolCall(id=item_id("fc"), call_id=delta["id"], name=function["name"],
                                                 arguments="", status="in_progress")
            out.append(self.sse(ResponseOutputItemEvent(type="response.output_item.added",
                                                        output_index=self.output_index, item=self.call)))
        if function.get("arguments") and self.call is not None:
            self.arguments.append(function["arguments"])
            out.append(self.sse(ResponseFunctionCallArgumentsDeltaEvent(
                item_id=self.call.id, output_index=self.output_index, delta=function["arguments"])))
        return out

    def close_call(self, status: str) -> list[str]:
        if self.call is None:
            return []
        index, arguments = self.output_index, "".join(self.arguments)
        item = self.call.model_copy(update={"arguments": arguments, "status": status})
        out = [self.sse(ResponseFunctionCallArgumentsDoneEvent(item_id=item.id, output_index=index,
                                                               arguments=arguments)),
               self.sse(ResponseOutputItemEvent(type="response.output_item.done", output_index=index, item=item))]
        self.items.append(item)
        self.call, self.arguments = None, []
        return out

    def finish(self, finish_reason: str | None, usage: ResponseUsage) -> list[str]:
        incomplete = finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        out = self.close_reasoning(status) + self.close_message(status) + self.close_call(status)
        if not any(item.type != "reasoning" for item in self.items):                    # nothing generated: an empty message, as the whole response has
            out += self.open_message() + self.close_message(status)
        response = self.head.model_copy(update=dict(
            status=status, output=self.items, usage=usage, completed_at=int(time.time()),
            incomplete_details=IncompleteDetails() if incomplete else None))
        return out + [self.sse(ResponseLifecycleEvent(type=f"response.{status}", response=response))]

    def fail(self, message: str) -> str:
        response = self.head.model_copy(update=dict(status="failed", output=self.items,
                                                    error=ResponseError(message=message)))
        return self.sse(ResponseLifecycleEvent(type="response.failed", response=response))


def responses_router(serving: OpenAIServing) -> APIRouter:
    responses = ResponsesServing(serving)     # OpenAI's Responses API, an adapter over the chat route
    router = APIRouter()

    @router.post("/v1/responses", response_model=None, responses={**RESPONSES_OPENAPI, **GENERATE_ERRORS})
    async def create_response(req: ResponsesRequest, raw: Request):
        return await responses.create(req, raw)

    return router
