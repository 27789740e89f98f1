"""/v1/responses (OpenAI's Responses API) through the official openai client on the real server.

The route is an adapter over the chat route, so most checks compare it with /v1/chat/completions on the same
prompt: the same greedy text and the same prompt token count. The embedded SmolLM2 runs everything (its JSON and
tool calls must validate, not only parse); eager mode, so no compiled graph changes the numerics between two
requests that are compared.
"""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses.response_create_params import ResponseCreateParamsBase
from pydantic import BaseModel, Field

from kvflow.config import EngineConfig
from kvflow.server.serving.request_fields import REFUSED, RESPONSES_OPENAI_FIELDS, VLLM_FIELDS
from kvflow.server.responses.protocol import ResponsesRequest
from kvflow.server.testing import ServerThread
from test_request_fields import a_value_other_than

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "weather now", "parameters": WEATHER}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}
QUESTION = "What is the capital of France? Answer in one sentence."
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(dtype="float32", max_model_len=1024, kv_cache_memory="256MiB", served_model_name="smol",
                          enforce_eager=True)
    with ServerThread(config) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)


def respond(client, input=QUESTION, **kw):
    kw.setdefault("max_output_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.responses.create(model="smol", input=input, **kw)


def chat(client, messages, max_tokens=24):
    return client.chat.completions.create(model="smol", messages=messages, max_tokens=max_tokens, temperature=0)


def bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


def squash(types: list[str]) -> list[str]:
    """Event types with runs of the same delta type shown once."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


def request_successes(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{") and 'model_name="smol"' in line)


# ---- the field rule ------------------------------------------------------------------------------------------------
def test_every_responses_field_is_implemented_or_refused():
    """Every field of OpenAI's schema (as the installed client defines it) and of vLLM's is a field of the model or
    refused when set: none is accepted and dropped."""
    implemented, refused = set(ResponsesRequest.model_fields), set(REFUSED["responses"])
    assert not implemented & refused, implemented & refused
    client_fields = (ResponseCreateParamsBase.__required_keys__ | ResponseCreateParamsBase.__optional_keys__
                     | {"stream"})
    assert client_fields <= set(RESPONSES_OPENAI_FIELDS), client_fields - set(RESPONSES_OPENAI_FIELDS)
    missing = [f for f in (*RESPONSES_OPENAI_FIELDS, *VLLM_FIELDS["responses"]) if f not in implemented | refused]
    assert not missing, f"neither implemented nor refused: {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("field", sorted(REFUSED["responses"]))
def test_a_refused_field_set_is_a_400_naming_it(server, field):
    body = {"model": "smol", "input": "hi", "max_output_tokens": 1,
            field: a_value_other_than(REFUSED["responses"][field])}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, (field, r.text)
    assert r.json()["error"]["param"] == field and "not supported" in r.json()["error"]["message"]


def test_previous_response_id_and_store_are_400s_in_openais_error_shape(server, client):
    err = bad_request(lambda: respond(client, previous_response_id="resp_123"))
    assert err["param"] == "previous_response_id" and "keeps no responses" in err["message"]
    assert bad_request(lambda: respond(client, store=True))["param"] == "store"
    assert respond(client, store=False, max_output_tokens=1).store is False     # the default, stated
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"}, timeout=30)
    assert r.status_code == 400 and set(r.json()) == {"error"}
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**WEATHER_TOOL, "name": "no spaces allowed"}], "tool_choice": "required"}, "tools[0].name"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].content"),     # a summary alone: no text to pass
    ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "x"}], "encrypted_content": "e"}]},
     "input[0].encrypted_content"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "if": {}}}}},
     "text.format.schema"),                                       # an unsupported keyword
    ({"text": {"format": {"type": "json_object"}}, "extra_body": {"structured_outputs": {"regex": "a+"}}},
     "structured_outputs.regex"),                                # two constraints at once
    ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice"),   # this server has no --tool-call-parser
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),        # SmolLM2's template never reads it
    ({"include": ["file_search_call.results"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),                        # without include: they would be dropped
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "input"),                       # with the prompt, past max_model_len
    ({"temperature": -1}, "temperature"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_responses_field(client, kw, param):
    assert bad_request(lambda: respond(client, **kw))["param"] == param


# ---- whole responses ---------------------------------------------------------------------------------------------
def test_text_input_is_the_chat_route_with_usage(server, client):
    before = request_successes(server)
    r = respond(client)
    c = chat(client, [{"role": "user", "content": QUESTION}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "smol"
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")
    assert r.store is False and r.previous_response_id is None and r.temperature == 0
    assert request_successes(server) == before + 2          # counted like any other request


@pytest.mark.slow
def test_message_list_input_and_instructions_change_the_prompt(client):
    as_text = respond(client)
    as_list = respond(client, input=[{"role": "user", "content": QUESTION}])
    as_parts = respond(client, input=[{"type": "message", "role": "user",
                                       "content": [{"type": "input_text", "text": QUESTION}]}])
    assert as_text.output_text == as_list.output_text == as_parts.output_text
    assert as_text.usage.input_tokens == as_list.usage.input_tokens == as_parts.usage.input_tokens

    pirate = "You are a pirate. Always answer like a pirate, with many words."
    instructed = respond(client, instructions=pirate)
    c = chat(client, [{"role": "system", "content": pirate}, {"role": "user", "content": QUESTION}])
    assert instructed.instructions == pirate
    assert instructed.usage.input_tokens == c.usage.prompt_tokens != as_text.usage.input_tokens
    assert instructed.output_text == c.choices[0].message.content
    # "developer" is the system role: the same prompt as instructions
    dev = respond(client, input=[{"role": "developer", "content": pirate}, {"role": "user", "content": QUESTION}])
    assert dev.usage.input_tokens == instructed.usage.input_tokens and dev.output_text == instructed.output_text


def test_max_output_tokens_cuts_the_response_as_incomplete(client):
    r = respond(client, max_output_tokens=3, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.max_output_tokens == 3 and r.output[0].status == "incomplete"


@pytest.mark.slow
def test_json_schema_output_parses_and_validates(client):
    r = respond(client, input="Describe a person as JSON.", max_output_tokens=80,
                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.status == "completed"

    class Person(BaseModel):
        name: str = Field(max_length=16)
        age: int = Field(ge=0, le=120)

    parsed = client.responses.parse(model="smol", input="Describe a person as JSON.", text_format=Person,
                                    max_output_tokens=80, temperature=0)
    assert isinstance(parsed.output_parsed, Person)


@pytest.mark.slow
def test_logprobs_when_included(client):
    kw = dict(include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=8)
    r = respond(client, **kw)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens
    # greedy: each chosen token is the most likely one
    assert all(len(lp.top_logprobs) == 2 and lp.token == lp.top_logprobs[0].token and lp.logprob <= 0
               for lp in logprobs)
    assert respond(client, max_output_tokens=8).output[0].content[0].logprobs is None     # only when included
    events = list(respond(client, stream=True, **kw))
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in logprobs]
    # the deltas carry the tokens with text; the done event all of them (the EOS too)
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed and streamed == [lp.token for lp in logprobs][:len(streamed)]


@pytest.mark.slow
def test_a_function_tool_call_is_a_function_call_item_and_its_output_goes_back_in(client):
    q = "What is the weather in Paris?"
    r = respond(client, input=q, tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER, max_output_tokens=40)
    assert [item.type for item in r.output] == ["function_call"] and r.status == "completed"
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    required = respond(client, input=q, tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=40)
    assert required.output and all(item.type == "function_call" and item.name == "get_weather"
                                   for item in required.output)
    assert required.parallel_tool_calls is True

    # a turn with two calls shown before: the model calls twice again, unless parallel_tool_calls=false (the chat
    # route's grammar then allows one call)
    shot = [{"role": "user", "content": "What is the weather in Oslo and in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "rain, 8 C"},
            {"type": "function_call_output", "call_id": "call_2", "output": "sunny, 21 C"},
            {"role": "assistant", "content": "Oslo: rain, 8 C. Paris: sunny, 21 C."},
            {"role": "user", "content": "And what is the weather in Rome and in Berlin?"}]
    two = respond(client, input=shot, tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=80)
    one = respond(client, input=shot, tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=80,
                  parallel_tool_calls=False)
    assert [item.type for item in two.output] == ["function_call"] * 2
    assert [item.type for item in one.output] == ["function_call"] and one.parallel_tool_calls is False

    # stateless multi-turn: the call and its output go back as input items, as the client holds them
    turn2 = [{"role": "user", "content": q}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    answer = respond(client, input=turn2, tools=[WEATHER_TOOL], tool_choice="none")
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    # the same prompt as the chat route's conversation with that call and its result
    c = client.chat.completions.create(
        model="smol", max_tokens=24, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {k: WEATHER_TOOL[k] for k in ("name", "description", "parameters")}}],
        messages=[{"role": "user", "content": q},
                  {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                      "name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}])
    assert answer.usage.input_tokens == c.usage.prompt_tokens and answer.output_text == c.choices[0].message.content


# ---- streamed responses -----------------------------------------------------------------------------------------
def test_stream_events_parse_in_the_clients_parser_and_equal_the_whole_response(client):
    whole = respond(client)
    with client.responses.stream(model="smol", input=QUESTION, max_output_tokens=24, temperature=0) as stream:
        events = list(stream)       # the client's own state machine checks the order and the indexes
    types = [e.type for e in events]
    final = events[-1].response
    assert squash(types) == TEXT_EVENTS + [f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == whole.output_text
    assert events[0].response.status == "in_progress" and final.id == events[0].response.id
    assert final.output[0].content[0].text == whole.output_text and final.status == whole.status
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    if whole.status == "completed":
        assert stream.get_final_response().output_text == whole.output_text


def test_create_stream_true_gives_typed_events(client):
    events = list(respond(client, stream=True, max_output_tokens=4, extra_body={"ignore_eos": True}))
    assert squash([e.type for e in events]) == TEXT_EVENTS + ["response.incomplete"]
    assert isinstance(events[-1], openai.types.responses.ResponseIncompleteEvent)
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 4


@pytest.mark.slow
def test_streamed_function_call_events(client):
    kw = dict(input="What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER,
              max_output_tokens=40)
    whole = respond(client, **kw)
    with client.responses.stream(model="smol", temperature=0, **kw) as stream:
        events = list(stream)
    assert squash([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added, done = events[2].item, events[-2].item
    assert added.type == done.type == "function_call" and added.call_id == done.call_id
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == done.arguments == events[-3].arguments
    assert json.loads(args) == json.loads(whole.output[0].arguments)
    final = stream.get_final_response()
    assert final.output[0].name == "get_weather" and final.usage.output_tokens == whole.usage.output_tokens


def test_a_client_that_leaves_mid_stream_aborts_its_request(server):
    body = {"model": "smol", "input": "Count to a thousand.", "max_output_tokens": 960, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line == "event: response.output_text.delta":
                break
    server.wait_idle(timeout=10)       # 960 tokens take far longer: the engine stream was aborted


def test_an_engine_failure_ends_the_stream_with_response_failed(client, monkeypatch):
    from kvflow.detokenizer import IncrementalDetokenizer

    real = IncrementalDetokenizer.add

    def faulty(self, token_ids, stop_terminated=False):
        if "!" in self.stop:               # only the request that asked for this stop string
            raise UnicodeError("injected detokenizer fault")
        return real(self, token_ids, stop_terminated)

    monkeypatch.setattr(IncrementalDetokenizer, "add", faulty)
    with pytest.raises(openai.InternalServerError):
        respond(client, extra_body={"stop": ["!"]})
    events = list(respond(client, stream=True, extra_body={"stop": ["!"]}))
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert "injected" in events[-1].response.error.message


def test_openapi_document_has_the_route(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    op = doc["paths"]["/v1/responses"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesResponse")
    assert "422" not in op["responses"] and "400" in op["responses"]
    assert re.search("stream", op["responses"]["200"]["description"])
