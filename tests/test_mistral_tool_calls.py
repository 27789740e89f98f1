"""Mistral's tool calls (--tool-call-parser mistral): both forms on crafted text, whole and cut into chunks anywhere,
and the 9-character call ids; then the real server with a template in Mistral Small 3.1's documented format, the
output forced under "auto", and tool_choice "required" / a named function with Mistral's ids."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from kvflow.server.serving.mistral_tool_calls import MistralToolParser, written
from kvflow.server.serving.tool_calls import ToolCallStreamer, extract_tool_calls, parse_tool_request
from tool_parser_checks import (TOOLS, auto, calls_of, check_prefixes_grow, check_server_reads,
                                check_whole_and_streamed, client_of, history, rendered, stream, tool_server)

MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")
LIST = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
UNFINISHED = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa'
CASES = [
    # before v11: a JSON list (or one object) after the marker
    (LIST, None, [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n\n[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
     '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "Let me check.\n\n",
     [("get_weather", {"city": "Oslo", "days": 2}), ("add", {"a": 1, "b": 2})]),
    ('[TOOL_CALLS]{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ('[TOOL_CALLS][{"name": "ping"}]', None, [("ping", {})]),
    (LIST + " trailing", None, [("get_weather", {"city": "Paris"})]),
    # v11 on: name [ARGS] arguments per call, each after its own marker
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", {"city": "Paris"})]),
    ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
     "Checking.", [("get_weather", {"city": "Paris", "days": 3}), ("add", {"a": 1, "b": 2})]),
    ('[TOOL_CALLS]add{"a": 1, "b": 2}', None, [("add", {"a": 1, "b": 2})]),      # a tokenizer's text without [ARGS]
    ('[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1, "b": 2}', None, [("add", {"a": 1, "b": 2})]),
    ('[TOOL_CALLS]add[ARGS]{"a": "[TOOL_C"}', None, [("add", {"a": "[TOOL_C"})]),
    # not calls: content as written
    ("The weather is sunny.", "The weather is sunny.", []),
    ("Use the [TOOL_CALL", "Use the [TOOL_CALL", []),
    ('[TOOL_CALLS][{"answer": 42}]', '[TOOL_CALLS][{"answer": 42}]', []),
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    (UNFINISHED, UNFINISHED, []),      # unfinished (max_tokens): content, as vLLM's whole reading has it
    ("", None, []),
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole(text, content, calls):
    result = extract_tool_calls(auto("mistral"), text)
    assert (result.content, calls_of(result)) == (content, calls)
    assert all(MISTRAL_ID.match(c["id"]) for c in result.tool_calls)


@pytest.mark.parametrize("text, content, calls", [c for c in CASES if c[0] != UNFINISHED])
def test_streamed_as_whole(text, content, calls):
    check_whole_and_streamed(auto("mistral"), text, content, calls)
    _, streamed = stream(auto("mistral"), [text])
    assert all(MISTRAL_ID.match(c["id"]) for c in streamed)


def test_malformed_arguments_of_the_newer_form_stay_a_call():
    """As vLLM: the model sees what it tried, rather than a call turned into prose."""
    text = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": '
    result = extract_tool_calls(auto("mistral"), text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in result.tool_calls] == [
        ("add", '{"a": 1, "b":')]
    _, streamed = stream(auto("mistral"), list(text))
    assert [(c["name"], c["arguments"]) for c in streamed] == [("add", '{"a": 1, "b":')]


@pytest.mark.parametrize("text", [c[0] for c in CASES] + [
    '[TOOL_CALLS]a[ARGS]{"x": 1}  [TOOL_CALLS]b[ARGS]{}', "x[TOOL_CALLS]get_we", '[TOOL_CALLS][{"name": "a", "ar'])
def test_every_prefix_only_adds(text):
    check_prefixes_grow(MistralToolParser(), text)


def test_the_arguments_stream_as_written():
    streamer = ToolCallStreamer(auto("mistral"))
    deltas = [d for ch in '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}' for d in streamer.push(ch)] + streamer.finish()
    fragments = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
    assert len(fragments) > 5 and "".join(fragments) == '{"a": 1, "b": 2}'


def test_forced_tool_choices_get_mistral_ids_too():
    """The ids come back in the next request's history, where Mistral's templates check them."""
    named = parse_tool_request(TOOLS, {"type": "function", "function": {"name": "add"}}, tool_parser="mistral")
    required = parse_tool_request(TOOLS, "required", tool_parser="mistral")
    call, = extract_tool_calls(named, '{"a": 1, "b": 2}').tool_calls
    assert MISTRAL_ID.match(call["id"])
    call, = extract_tool_calls(required, '[{"name": "add", "arguments": {"a": 1, "b": 2}}]').tool_calls
    assert MISTRAL_ID.match(call["id"])
    _, streamed = stream(required, ['[{"name": "add", "arguments": {"a": 1, "b": 2}}]'])
    assert MISTRAL_ID.match(streamed[0]["id"])
    assert extract_tool_calls(parse_tool_request(TOOLS, "required", tool_parser="hermes"),
                              '[{"name": "add", "arguments": {}}]').tool_calls[0]["id"].startswith("call_")


def test_written_calls_read_back():
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert calls_of(extract_tool_calls(auto("mistral"), written(calls))) == [(c["name"], c["arguments"]) for c in calls]
    from kvflow.server.serving.tool_prompt import tools_system_prompt
    assert "[TOOL_CALLS]" in tools_system_prompt(auto("mistral"))


# ---------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tool_server(tmp_path_factory.mktemp("tiny-mistral"), "mistral", "mistral_format.jinja") as s:
        yield s


@pytest.mark.slow
def test_the_server_reads_mistral_calls_and_the_template_takes_their_ids(server):
    """The template in Mistral Small 3.1's format renders the tools, the server's calls (with their 9-character ids,
    which it checks, as Mistral's templates do) and their results; the parser reads the calls the template wrote back
    as the same calls."""
    client = client_of(server)
    output = ('Checking both.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "add", "arguments": {"a": 2, "b": 3}}]')
    calls = check_server_reads(client, output, "Checking both.",
                               [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})])
    assert all(MISTRAL_ID.match(c.id) for c in calls)
    check_server_reads(client, '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}', None, [("add", {"a": 2, "b": 3})])
    prompt = rendered(server, history(calls))
    assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"' in prompt   # the tools
    assert (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{calls[0].id}"}}, '
            f'{{"name": "add", "arguments": {{"a": 2, "b": 3}}, "id": "{calls[1].id}"}}]') in prompt   # the calls
    assert f'[TOOL_RESULTS]{{"content": "sunny, 21 C", "call_id": "{calls[1].id}"}}[/TOOL_RESULTS]' in prompt
    turn = prompt[prompt.index("[TOOL_CALLS]"):prompt.index("[TOOL_RESULTS]")]
    assert calls_of(extract_tool_calls(auto("mistral"), turn)) == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})]
    # an id that is not Mistral's: the template refuses the history, a 400
    turns = history(calls)
    turns[1]["tool_calls"][0]["id"] = "call_1"
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "messages": turns, "tools": TOOLS}, timeout=60)
    assert r.status_code == 400 and "9 letters or digits" in r.text, r.text
    # "required" and a named function: the grammar's calls, with Mistral's ids
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"], "additionalProperties": False}}}]
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Add."}], tools=tools,
                                           tool_choice=choice, parallel_tool_calls=False, max_tokens=60)
        call, = r.choices[0].message.tool_calls
        assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a"}
        assert MISTRAL_ID.match(call.id)
