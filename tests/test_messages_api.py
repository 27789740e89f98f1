"""Anthropic's Messages API (/v1/messages) end to end, through the official `anthropic` client: the real server on
the embedded SmolLM2 where the content matters (greedy text, tool input that must validate), the tiny random model
for errors and the field rule, and the route's error handling over a fake engine for the engine's failures."""
from __future__ import annotations

import json
import logging

import anthropic
import httpx
import jsonschema
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kvflow.async_engine import EngineOverloadedError, EngineShutdownError
from kvflow.config import EngineConfig
from kvflow.server.messages.protocol import (CacheControl, InputMessage, JsonOutputFormat, MessagesMetadata,
                                             MessagesRequest, MessagesTool, MessagesToolChoice, OutputConfig,
                                             TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock)
from kvflow.server.messages.routes import messages_router
from kvflow.server.serving.request_fields import MESSAGES_FIELDS, MESSAGES_REFUSED
from kvflow.server.serving.serving import OpenAIServing
from kvflow.server.testing import ServerThread
from test_server_handlers import FakeEngine
from tiny_models import make_tiny_hf_model

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "the weather now", "input_schema": WEATHER},
         {"name": "add", "description": "add two numbers", "input_schema": ADD}]
GREEDY = {"temperature": 0}          # the anthropic client has no keyword for it: extra_body sends it
KEY = "s3cret"


# ---------------------------------------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def smol():
    config = EngineConfig(dtype="float32", max_model_len=1024, kv_cache_memory="256MiB", served_model_name="smol",
                          enforce_eager=True)
    with ServerThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def client(smol):
    return anthropic.Anthropic(base_url=smol.url, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny random model behind an API key (which the anthropic client sends as x-api-key)."""
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-messages"), family="llama", seed=3,
                              max_position_embeddings=1024)      # room for the tools' prompt
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=1024, kv_cache_memory="8MiB",
                          served_model_name="tiny", enforce_eager=True)
    with ServerThread(config, api_key=KEY, max_request_body_size="64KiB") as s:
        yield s


@pytest.fixture(scope="module")
def tiny_client(tiny):
    return anthropic.Anthropic(base_url=tiny.url, api_key=KEY, max_retries=0, timeout=60)


def prompt_tokens(server, messages, **chat) -> int:
    """The prompt's size as /tokenize counts the chat form (the very ids the chat route runs)."""
    r = httpx.post(server.url + "/tokenize", json={"model": "smol", "messages": messages, **chat}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def prompt_of(message) -> int:
    """The whole prompt of a Messages reply: Anthropic counts the prefix-cache hits apart."""
    assert message.usage.cache_creation_input_tokens == 0
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def successes(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def anthropic_error(resp: httpx.Response, status: int, kind: str) -> str:
    """The message of an error response in Anthropic's shape (and nothing else in it)."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    return body["error"]["message"]


# ---------------------------------------------------------------------------------------------- create
@pytest.mark.slow
def test_create_answers_a_message_with_usage_and_the_system_prompt_in_the_prompt(smol, client):
    user = "Name three colors."
    before = successes(smol)
    r = client.messages.create(model="smol", max_tokens=16, messages=[{"role": "user", "content": user}],
                               extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.model == "smol" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text.strip()
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert 0 < r.usage.output_tokens <= 16
    assert prompt_of(r) == prompt_tokens(smol, [{"role": "user", "content": user}])

    system = "You are a pirate. Answer like a pirate."
    as_text = client.messages.create(model="smol", max_tokens=4, system=system,
                                     messages=[{"role": "user", "content": user}], extra_body=GREEDY)
    as_blocks = client.messages.create(model="smol", max_tokens=4, system=[{"type": "text", "text": system}],
                                       messages=[{"role": "user", "content": user}], extra_body=GREEDY)
    with_system = prompt_tokens(smol, [{"role": "system", "content": system}, {"role": "user", "content": user}])
    assert prompt_of(as_text) == prompt_of(as_blocks) == with_system != prompt_of(r)
    assert successes(smol) == before + 3          # the metrics count these requests like any other


def test_a_repeated_prompt_reads_its_prefix_from_the_cache(client):
    messages = [{"role": "user", "content": "Tell me about the prefix cache of kvflow, in one sentence. " * 3}]
    first = client.messages.create(model="smol", max_tokens=2, messages=messages)
    second = client.messages.create(model="smol", max_tokens=2, messages=messages)
    assert prompt_of(first) == prompt_of(second)
    assert second.usage.cache_read_input_tokens >= 16 and second.usage.cache_read_input_tokens % 16 == 0
    assert second.usage.input_tokens == prompt_of(second) - second.usage.cache_read_input_tokens


def test_max_tokens_stops_with_max_tokens(client):
    r = client.messages.create(model="smol", max_tokens=3, messages=[{"role": "user", "content": "Write a story."}],
                               extra_body=GREEDY)
    assert (r.stop_reason, r.stop_sequence, r.usage.output_tokens) == ("max_tokens", None, 3)


@pytest.mark.slow
def test_stop_sequences_stop_with_stop_sequence(client):
    messages = [{"role": "user", "content": "List the days of the week."}]
    client.messages.create(model="smol", max_tokens=1, messages=messages)     # both runs find the same prefix cached
    text = client.messages.create(model="smol", max_tokens=24, messages=messages, extra_body=GREEDY).content[0].text
    # a piece of the greedy text, first seen past its start: the same request stops just before it
    at = next(i for i in range(3, len(text) - 3) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    stop = text[at:at + 3]
    r = client.messages.create(model="smol", max_tokens=24, messages=messages, stop_sequences=["zzzq", stop],
                               extra_body=GREEDY)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert r.content[0].text == text[:at]


@pytest.mark.slow
def test_a_forced_tool_gives_a_tool_use_block_whose_input_follows_the_schema(client):
    r = client.messages.create(model="smol", max_tokens=64, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "get_weather"},
                               messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
    assert r.stop_reason == "tool_use"
    [block] = r.content
    assert block.type == "tool_use" and block.name == "get_weather" and isinstance(block.input, dict)
    jsonschema.validate(block.input, WEATHER)

    r = client.messages.create(model="smol", max_tokens=200, tools=TOOLS, tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "Add 2 and 3."}])
    assert r.stop_reason == "tool_use" and r.content and all(b.type == "tool_use" for b in r.content)
    for b in r.content:
        jsonschema.validate(b.input, {"get_weather": WEATHER, "add": ADD}[b.name])
    assert len({b.id for b in r.content}) == len(r.content)


@pytest.mark.slow
def test_structured_output_follows_output_config_format(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    r = client.messages.create(model="smol", max_tokens=32,
                               output_config={"format": {"type": "json_schema", "schema": schema}},
                               messages=[{"role": "user", "content": "Pick a color, as JSON."}])
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)


def test_a_conversation_with_tool_use_and_tool_result_reaches_the_prompt_as_the_chat_route_builds_it(smol, client):
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "unit": "celsius"}}

    def conversation(is_error=False):
        return [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, call]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": is_error,
                                              "content": [{"type": "text", "text": "-3 degrees"}]},
                                             {"type": "text", "text": "Summarize it."}]}]

    r = client.messages.create(model="smol", max_tokens=8, tools=TOOLS, tool_choice={"type": "none"},
                               messages=conversation(), extra_body=GREEDY)
    assert r.stop_reason in ("end_turn", "max_tokens") and r.content[0].type == "text"
    chat = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [{"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call["input"])}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "-3 degrees"},
            {"role": "user", "content": "Summarize it."}]
    chat_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                    "parameters": t["input_schema"]}} for t in TOOLS]
    assert prompt_of(r) == prompt_tokens(smol, chat, tools=chat_tools, tool_choice="none")
    failed = client.messages.create(model="smol", max_tokens=1, tools=TOOLS, tool_choice={"type": "none"},
                                    messages=conversation(is_error=True))
    chat[2]["content"] = "Error: -3 degrees"       # a failed call, as the model reads it
    assert prompt_of(failed) == prompt_tokens(smol, chat, tools=chat_tools, tool_choice="none") > prompt_of(r)


def test_consecutive_turns_of_one_role_are_one_turn_and_a_final_assistant_turn_is_continued(smol, client):
    split = client.messages.create(model="smol", max_tokens=1, messages=[
        {"role": "user", "content": "Hello."}, {"role": "user", "content": [{"type": "text", "text": "Bye."}]}])
    one = [{"role": "user", "content": [{"type": "text", "text": "Hello."}, {"type": "text", "text": "Bye."}]}]
    assert prompt_of(split) == prompt_tokens(smol, one)

    r = client.messages.create(model="smol", max_tokens=4, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": "One, two,"}])
    assert not r.content[0].text.startswith("One, two,")      # the reply continues the prefill, never repeats it
    assert prompt_of(r) == prompt_tokens(smol, [{"role": "user", "content": "Count to ten."},
                                                {"role": "assistant", "content": "One, two,"}],
                                         continue_final_message=True, add_generation_prompt=False)


# ---------------------------------------------------------------------------------------------- stream
def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed response, as the wire carries them."""
    events, name = [], None
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


@pytest.mark.slow
def test_stream_is_parsed_by_the_client_and_equals_the_greedy_message(smol, client):
    body = dict(model="smol", max_tokens=24, messages=[{"role": "user", "content": "Describe the sea in a sentence."}])
    client.messages.create(**{**body, "max_tokens": 1})        # both runs below then find the same prefix cached
    created = client.messages.create(**body, extra_body=GREEDY)
    with client.messages.stream(**body, extra_body=GREEDY) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == final.content[0].text == created.content[0].text
    assert (final.stop_reason, final.stop_sequence) == (created.stop_reason, created.stop_sequence)
    assert final.usage.output_tokens == created.usage.output_tokens > 0
    assert prompt_of(final) == prompt_of(created) and final.usage.input_tokens == created.usage.input_tokens

    events = raw_events(smol, {**body, **GREEDY})
    names = [n for n, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-2:] == ["message_delta",
                                                                                             "message_stop"]
    assert names[3:-3] == ["content_block_delta"] * (len(names) - 6) and names[-3] == "content_block_stop"
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == created.content[0].text
    assert events[-2][1]["delta"]["stop_reason"] == created.stop_reason


@pytest.mark.slow
def test_stream_of_a_forced_tool_streams_its_input_as_json_deltas(smol, client):
    body = dict(model="smol", max_tokens=64, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    with client.messages.stream(**body) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds
    assert final.stop_reason == "tool_use" and final.usage.output_tokens > 0
    [block] = final.content
    assert block.type == "tool_use" and block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER)
    events = raw_events(smol, body)
    assert [d["content_block"]["type"] for n, d in events if n == "content_block_start"] == ["tool_use"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.slow
def test_errors_come_in_anthropics_shape_and_the_client_raises_its_own_classes(tiny, tiny_client):
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as e:
        tiny_client.messages.create(model="claude-nope", max_tokens=2, messages=user)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        tiny_client.messages.create(model="tiny", max_tokens=2, messages=user,
                                    thinking={"type": "enabled", "budget_tokens": 2048})
    assert e.value.body["error"]["message"].startswith("thinking.budget_tokens: ")   # no --reasoning-parser
    with pytest.raises(anthropic.BadRequestError) as e:
        tiny_client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    assert e.value.body["error"]["message"].startswith("messages[0].content[0]: ") and "'image'" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as e:       # a chat-path 400, named as the Messages API spells it
        tiny_client.messages.create(model="tiny", max_tokens=2, messages=user, stop_sequences=["x"] * 1000)
    assert e.value.body["error"]["message"].startswith("stop_sequences: ")
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=tiny.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=user)
    assert e.value.body["error"]["type"] == "authentication_error"

    def post(body=None, content=None, headers=None):
        return httpx.post(tiny.url + "/v1/messages", json=body, content=content, timeout=60,
                          headers={"x-api-key": KEY, **(headers or {})})

    assert "max_tokens" in anthropic_error(post({"model": "tiny", "messages": user}), 400, "invalid_request_error")
    msg = anthropic_error(post({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": 5}]}),
                          400, "invalid_request_error")
    assert msg.startswith("messages[0].content")                 # pydantic's errors, by path
    msg = anthropic_error(post({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text"}]}]}), 400, "invalid_request_error")
    assert msg.startswith("messages[0].content[0].text: ")
    assert "malformed JSON" in anthropic_error(post(content=b"{nope", headers={"content-type": "application/json"}),
                                               400, "invalid_request_error")
    anthropic_error(post({"model": "tiny", "max_tokens": 0, "messages": user}), 400, "invalid_request_error")
    anthropic_error(post({"model": "tiny", "max_tokens": 2, "messages": user, "x": "y" * 70_000}), 413,
                    "request_too_large")
    no_key = httpx.post(tiny.url + "/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": user})
    anthropic_error(no_key, 401, "authentication_error")
    bearer = httpx.post(tiny.url + "/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": user},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    # the other routes keep OpenAI's shape
    assert set(httpx.post(tiny.url + "/v1/chat/completions", json={}).json()) == {"error"}
    # the OpenAPI document shows the route, its body and its errors' shape
    op = httpx.get(tiny.url + "/openapi.json").json()["paths"]["/v1/messages"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/MessagesRequest")
    assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/MessagesErrorResponse")
    assert "422" not in op["responses"]


@pytest.mark.slow
def test_tool_choice_errors_name_the_messages_fields(tiny_client):
    user = [{"role": "user", "content": "hi"}]
    cases = [({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice: "),
             ({"tools": TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
              "tool_choice.disable_parallel_tool_use: "),
             ({"tools": [{**TOOLS[0], "strict": True}], "tool_choice": {"type": "auto"}}, "tools[0].strict: "),
             ({"tools": [{"name": "bad name!", "input_schema": WEATHER}], "tool_choice": {"type": "any"}},
              "tools[0].name: "),
             ({"tools": [{"name": "f", "input_schema": {"type": "array"}}], "tool_choice": {"type": "any"}},
              "tools[0].input_schema.type: "),
             ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type: "),
             ({"tools": TOOLS}, "tool_choice: ")]     # "auto" (the default) needs --tool-call-parser
    for extra, prefix in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            tiny_client.messages.create(model="tiny", max_tokens=2, messages=user, extra_body=extra)
        assert e.value.body["error"]["message"].startswith(prefix), (extra, e.value.body)
    for choice in ({"type": "tool", "name": "add", "disable_parallel_tool_use": True},
                   {"type": "any", "disable_parallel_tool_use": True}):
        r = tiny_client.messages.create(model="tiny", max_tokens=40, messages=user, tools=TOOLS, tool_choice=choice)
        assert r.stop_reason in ("tool_use", "max_tokens")
        assert len([b for b in r.content if b.type == "tool_use"]) <= 1


# ---------------------------------------------------------------------------------------------- count_tokens
def test_count_tokens_counts_the_prompt_that_create_runs_for_the_same_body(tiny, tiny_client):
    """client.messages.count_tokens on a body with a system prompt, tools, a tool_use / tool_result exchange and a
    prefill: its count is the prompt a real /v1/messages call on the same body runs (and the tools count)."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}
    body = {"model": "tiny", "system": [{"type": "text", "text": "You add numbers."}], "tools": TOOLS,
            "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "What is 1 + 2?"},
                         {"role": "assistant", "content": [call]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": "3"}]},
                         {"role": "assistant", "content": "The sum is"}]}
    counted = tiny_client.messages.count_tokens(**body)
    created = tiny_client.messages.create(max_tokens=1, **body)
    assert counted.input_tokens == prompt_of(created) > 0
    without_tools = tiny_client.messages.count_tokens(**{k: v for k, v in body.items()
                                                         if k not in ("tools", "tool_choice")})
    without_system = tiny_client.messages.count_tokens(**{k: v for k, v in body.items() if k != "system"})
    assert 0 < without_tools.input_tokens < counted.input_tokens
    assert 0 < without_system.input_tokens < counted.input_tokens
    # as Claude Code calls it: ?beta=true, and the very body it sends to /v1/messages (max_tokens and all)
    r = httpx.post(tiny.url + "/v1/messages/count_tokens?beta=true", json={**body, "max_tokens": 64,
                   "temperature": 0}, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200 and r.json() == {"input_tokens": counted.input_tokens}, r.text
    r = httpx.post(tiny.url + "/v1/messages?beta=true", json={**body, "max_tokens": 1},
                   headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text


def test_count_tokens_errors_come_in_anthropics_shape(tiny):
    post = lambda body: httpx.post(tiny.url + "/v1/messages/count_tokens", json=body,  # noqa: E731
                                   headers={"x-api-key": KEY}, timeout=60)
    user = [{"role": "user", "content": "hi"}]
    assert anthropic_error(post({"model": "tiny", "messages": user, "stream": True}), 400,
                           "invalid_request_error").startswith("stream: ")
    assert anthropic_error(post({"model": "tiny", "messages": []}), 400, "invalid_request_error").startswith(
        "messages: ")
    # a thinking budget needs --reasoning-parser (this server has none), for counting as for /v1/messages
    refused = anthropic_error(post({"model": "tiny", "messages": user, "thinking": {"type": "enabled",
                                    "budget_tokens": 1024}}), 400, "invalid_request_error")
    assert refused.startswith("thinking.budget_tokens: ") and "--reasoning-parser" in refused
    anthropic_error(post({"model": "claude-nope", "messages": user}), 404, "not_found_error")
    r = httpx.post(tiny.url + "/v1/messages/count_tokens", json={"model": "tiny", "messages": user}, timeout=60)
    anthropic_error(r, 401, "authentication_error")


def test_engine_failures_come_in_anthropics_shape():
    """429, 503 and 500 (whole, and as a stream's error event) over a fake engine: the route's own handling."""
    body = {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}

    def app(engine) -> TestClient:
        app = FastAPI()
        app.include_router(messages_router(OpenAIServing(engine)))
        return TestClient(app)

    r = app(FakeEngine(refuse=EngineOverloadedError("the queue is full"))).post("/v1/messages", json=body)
    assert "queue is full" in anthropic_error(r, 429, "rate_limit_error") and r.headers["retry-after"] == "1"
    r = app(FakeEngine(refuse=EngineShutdownError("shutting down"))).post("/v1/messages", json=body)
    anthropic_error(r, 503, "overloaded_error")
    anthropic_error(app(FakeEngine(fail=True)).post("/v1/messages", json=body), 500, "api_error")
    failing = FakeEngine(fail=True)
    with app(failing).stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "event: message_start" and lines[-2] == "event: error"
    assert json.loads(lines[-1][6:])["error"]["type"] == "api_error"
    assert all(s.closed for s in failing.streams)


# ---------------------------------------------------------------------------------------------- the field rule
PARTS = {"request": MessagesRequest, "message": InputMessage, "text": TextBlock, "tool_use": ToolUseBlock,
         "tool_result": ToolResultBlock, "tool": MessagesTool, "tool_choice": MessagesToolChoice,
         "metadata": MessagesMetadata, "output_config": OutputConfig, "format": JsonOutputFormat,
         "cache_control": CacheControl, "thinking": ThinkingBlock}


def test_every_messages_field_is_implemented_or_refused():
    assert set(PARTS) == set(MESSAGES_FIELDS) == set(MESSAGES_REFUSED)
    for kind, model in PARTS.items():
        implemented = {f.alias or name for name, f in model.model_fields.items()}
        refused = set(MESSAGES_REFUSED[kind])
        assert not implemented & refused, (kind, implemented & refused)
        assert implemented | refused == set(MESSAGES_FIELDS[kind]), (kind, set(MESSAGES_FIELDS[kind]) ^ (
            implemented | refused))


def placed(kind: str, name: str, value) -> tuple[dict, str]:
    """A request with `name` = `value` on a part of kind `kind`, and that field's path."""
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    text = {"type": "text", "text": "hi"}
    if kind == "request":
        return {**body, name: value}, name
    if kind == "message":
        body["messages"][0][name] = value
        return body, f"messages[0].{name}"
    if kind in ("text", "cache_control"):
        block = {**text, name: value} if kind == "text" else {**text, "cache_control": {"type": "ephemeral",
                                                                                          name: value}}
        body["messages"][0]["content"] = [block]
        return body, "messages[0].content[0]." + (name if kind == "text" else f"cache_control.{name}")
    if kind == "tool_use":
        body["messages"] += [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1, "b": 2}, name: value}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}]}]
        return body, f"messages[1].content[0].{name}"
    if kind == "tool_result":
        body["messages"] += [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1, "b": 2}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3", name: value}]}]
        return body, f"messages[2].content[0].{name}"
    if kind == "tool":
        return {**body, "tools": [{**TOOLS[1], name: value}], "tool_choice": {"type": "none"}}, f"tools[0].{name}"
    if kind == "tool_choice":
        return {**body, "tools": TOOLS, "tool_choice": {"type": "none", name: value}}, f"tool_choice.{name}"
    if kind in ("metadata", "output_config"):
        return {**body, kind: {name: value}}, f"{kind}.{name}"
    raise AssertionError(kind)


REFUSED_CASES = [(kind, name) for kind, fields in MESSAGES_REFUSED.items() for name in fields]


@pytest.mark.slow
@pytest.mark.parametrize("kind, name", REFUSED_CASES)
def test_a_refused_field_is_a_400_naming_its_path(tiny, kind, name):
    body, path = placed(kind, name, [1, 2])
    r = httpx.post(tiny.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    message = anthropic_error(r, 400, "invalid_request_error")
    assert message.startswith(f"{path}: not supported"), message


@pytest.mark.slow
@pytest.mark.parametrize("kind, name", REFUSED_CASES)
def test_a_refused_field_at_a_value_that_asks_for_nothing_is_accepted(tiny, kind, name):
    for value in (None, *MESSAGES_REFUSED[kind][name]):
        body, _ = placed(kind, name, value)
        r = httpx.post(tiny.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
        assert r.status_code == 200 and r.json()["type"] == "message", (name, value, r.text)


@pytest.mark.slow
def test_implemented_extras_are_accepted_and_unknown_fields_ignored_and_logged_once(tiny, tiny_client, caplog):
    with caplog.at_level(logging.WARNING, logger="kvflow.server"):
        for _ in range(2):
            r = tiny_client.messages.create(
                model="tiny", max_tokens=2, metadata={"user_id": "u-1"}, service_tier="standard_only",
                cache_control={"type": "ephemeral"}, system=[{"type": "text", "text": "Be brief.",
                                                              "cache_control": {"type": "ephemeral", "ttl": "5m"}}],
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"top_p": 0.9, "top_k": 5, "temperature": 0.5, "a_field_nobody_defines": 1})
            assert r.type == "message" and r.usage.output_tokens > 0
    logged = [rec for rec in caplog.records if "a_field_nobody_defines" in rec.getMessage()]
    assert len(logged) == 1, logged
