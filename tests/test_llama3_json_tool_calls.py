"""Llama 3.x's JSON tool calls (--tool-call-parser llama3_json, llama4_json): the parser on crafted text, whole and
cut into chunks anywhere; then the real server with a template in Llama 3.1's documented JSON tool-calling format,
the output forced under "auto"."""
from __future__ import annotations

import json

import pytest

from kvflow.server.serving.llama3_json_tool_calls import Llama3JsonToolParser, written
from kvflow.server.serving.tool_calls import extract_tool_calls
from tool_parser_checks import (auto, calls_of, check_forced_tool_choice, check_prefixes_grow, check_server_reads,
                                check_whole_and_streamed, client_of, history, rendered, tool_server)

PARIS = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
UNFINISHED = '{"name": "get_weather", "parameters": {"city": "Par'
CASES = [
    (PARIS, None, [("get_weather", {"city": "Paris"})]),
    ("<|python_tag|>" + PARIS, None, [("get_weather", {"city": "Paris"})]),
    ("\n " + PARIS + "\n", None, [("get_weather", {"city": "Paris"})]),
    # several calls, `;`-separated; "arguments" read as "parameters"
    (PARIS + '; {"name": "add", "arguments": {"a": 1, "b": 2.5}}', None,
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2.5})]),
    ('<|python_tag|>{"name":"add","parameters":{"a":1,"b":2}};{"name":"get_weather","parameters":{"city":"Oslo",'
     '"days":3}}', None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "days": 3})]),
    # the name after the arguments; nested objects and braces in strings
    ('{"parameters": {"city": "{Rome}", "x": {"y": [1, {"z": "}"}]}}, "name": "get_weather"}', None,
     [("get_weather", {"city": "{Rome}", "x": {"y": [1, {"z": "}"}]}})]),
    # what follows the calls is dropped, as vLLM drops the text around them
    (PARIS + "\nI will tell you once I know.", None, [("get_weather", {"city": "Paris"})]),
    # not calls: content as written
    ("The weather is sunny.", "The weather is sunny.", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "get_weather"}', '{"name": "get_weather"}', []),
    ("Here: " + PARIS, "Here: " + PARIS, []),
    ("{not json", "{not json", []),
    ("<|python_ta", "<|python_ta", []),
    # unfinished (max_tokens): the whole output is content, as vLLM's whole reading has it
    (UNFINISHED, UNFINISHED, []),
    ("", None, []),
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole(text, content, calls):
    result = extract_tool_calls(auto("llama3_json"), text)
    assert (result.content, calls_of(result)) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [c for c in CASES if c[0] != UNFINISHED])
def test_streamed_as_whole(text, content, calls):
    check_whole_and_streamed(auto("llama3_json"), text, content, calls)
    check_whole_and_streamed(auto("llama4_json"), text, content, calls, seeds=range(1))


def test_an_unfinished_call_streams_what_there_is():
    """A stream has sent the call by the time the output ends unfinished; the whole reading makes it content."""
    content, calls = Llama3JsonToolParser().partial(UNFINISHED, final=True)
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("get_weather", '{"city": "Par')])


@pytest.mark.parametrize("text", [c[0] for c in CASES] + [
    PARIS + "; " + PARIS, '{"name": "a", "parameters": {"s": "x;{y}"}} ; {"nam', "<|python_tag|>\n{"])
def test_every_prefix_only_adds(text):
    check_prefixes_grow(Llama3JsonToolParser(), text)


def test_arguments_stream_before_the_call_ends():
    from kvflow.server.serving.tool_calls import ToolCallStreamer
    streamer = ToolCallStreamer(auto("llama3_json"))
    deltas = [d for ch in PARIS for d in streamer.push(ch)]
    fragments = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
    assert len(fragments) > 5 and json.loads("".join(fragments)) == {"city": "Paris"}


def test_written_calls_read_back():
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert calls_of(extract_tool_calls(auto("llama3_json"), written(calls))) == [
        (c["name"], c["arguments"]) for c in calls]


# ---------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tool_server(tmp_path_factory.mktemp("tiny-llama3-json"), "llama3_json", "llama3_json_format.jinja") as s:
        yield s


@pytest.mark.slow
def test_the_server_reads_llama3_calls_and_the_template_writes_them_back(server):
    """The template in Llama 3.1's format renders the tools, the server's call (as the model wrote it) and its
    result; the parser reads the call the template wrote back as the same call."""
    client = client_of(server)
    output = "<|python_tag|>" + PARIS
    calls = check_server_reads(client, output, None, [("get_weather", {"city": "Paris"})])
    check_server_reads(client, "It is sunny in Paris.", "It is sunny in Paris.", [])
    prompt = rendered(server, history(calls))
    assert '"name": "get_weather"' in prompt and "Environment: ipython" in prompt        # the tools
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in prompt   # the call, as the model
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 21 C<|eot_id|>" in prompt   # the result
    turn = prompt.split("<|start_header_id|>assistant<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
    assert calls_of(extract_tool_calls(auto("llama3_json"), turn)) == [("get_weather", {"city": "Paris"})]
    check_forced_tool_choice(client)


def test_a_template_without_tools_is_taught_the_format():
    from kvflow.server.serving.tool_prompt import tools_system_prompt
    assert '{"name": <function name>, "parameters": <arguments object>}' in tools_system_prompt(auto("llama3_json"))
