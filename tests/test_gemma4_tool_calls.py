"""Gemma 4's tool calls (--tool-call-parser gemma4): the parser on crafted text, whole and cut into chunks anywhere;
then the real server with a template in Gemma 4's documented format, the output forced under "auto"."""
from __future__ import annotations

import pytest

from kvflow.server.serving.gemma4_tool_calls import Gemma4ToolParser, written
from kvflow.server.serving.tool_calls import ToolCallStreamer, extract_tool_calls
from tool_parser_checks import (auto, calls_of, check_forced_tool_choice, check_prefixes_grow, check_server_reads,
                                check_whole_and_streamed, client_of, history, rendered, tool_server)

Q = '<|"|>'
PARIS = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3}}<tool_call|>"
UNFINISHED = f"<|tool_call>call:get_weather{{city:{Q}Par"
CASES = [
    (PARIS, None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("Let me check both.\n" + PARIS + "<|tool_call>call:add{a:1.5,b:-2}<tool_call|>", "Let me check both.",
     [("get_weather", {"city": "Paris", "days": 3}), ("add", {"a": 1.5, "b": -2})]),
    # every kind of value; braces, commas and colons inside strings; a delimited key
    (f"<|tool_call>call:f{{s:{Q}a, {{b}}: [c]{Q},t:true,u:false,n:null,o:{{k:{Q}v{Q},l:[1,{Q}x{Q},{{m:none}}]}},"
     f"e:[],{Q}q k{Q}:7}}<tool_call|>", None,
     [("f", {"s": "a, {b}: [c]", "t": True, "u": False, "n": None, "o": {"k": "v", "l": [1, "x", {"m": None}]},
             "e": [], "q k": 7})]),
    ("<|tool_call>call:ping{}<tool_call|>", None, [("ping", {})]),
    ("<|tool_call>call:my-tool.v2{x:1}<tool_call|>", None, [("my-tool.v2", {"x": 1})]),
    (PARIS + "\nDone.", None, [("get_weather", {"city": "Paris", "days": 3})]),          # after the calls: dropped
    ("<|tool_call>call:add{a:1,a:2}<tool_call|>", None, [("add", {"a": 1})]),         # twice: the first counts
    # not calls: content as written
    ("It is sunny.", "It is sunny.", []),
    ("<|tool_call>get_weather{}<tool_call|>", "<|tool_call>get_weather{}<tool_call|>", []),
    ("Use <|tool_ca", "Use <|tool_ca", []),
    (UNFINISHED, UNFINISHED, []),       # unfinished (max_tokens): no call when the whole output is read, as vLLM's
    ("", None, []),
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole(text, content, calls):
    result = extract_tool_calls(auto("gemma4"), text)
    assert (result.content, calls_of(result)) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [c for c in CASES if c[0] != UNFINISHED])
def test_streamed_as_whole(text, content, calls):
    check_whole_and_streamed(auto("gemma4"), text, content, calls)


@pytest.mark.parametrize("text", [c[0] for c in CASES] + [
    PARIS + PARIS, f"x<|tool_call>call:a{{b:{Q}c", "<|tool_call>c"])
def test_every_prefix_only_adds(text):
    check_prefixes_grow(Gemma4ToolParser(), text)


def test_arguments_stream_one_at_a_time():
    streamer = ToolCallStreamer(auto("gemma4"))
    deltas = [d for ch in PARIS for d in streamer.push(ch)] + streamer.finish()
    fragments = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
    assert fragments == ["{", '"city": "Paris"', ', "days": 3}']


def test_written_calls_read_back():
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}},
             {"name": "f", "arguments": {"o": {"k": [1, "x", None, True]}}}]
    assert calls_of(extract_tool_calls(auto("gemma4"), written(calls))) == [(c["name"], c["arguments"]) for c in calls]
    from kvflow.server.serving.tool_prompt import tools_system_prompt
    assert "<|tool_call>call:NAME{" in tools_system_prompt(auto("gemma4"))


# ---------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tool_server(tmp_path_factory.mktemp("tiny-gemma4"), "gemma4", "gemma4_format.jinja") as s:
        yield s


@pytest.mark.slow
def test_the_server_reads_gemma4_calls_and_the_template_writes_them_back(server):
    """The template in Gemma 4's format renders the tools, the server's calls (as the model wrote them) and their
    results (inside the model's turn, left open for the model to go on); the parser reads the calls the template
    wrote back as the same calls."""
    client = client_of(server)
    output = (f"Checking.<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
              "<|tool_call>call:add{a:2,b:3.5}<tool_call|>")
    calls = check_server_reads(client, output, "Checking.",
                               [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3.5})])
    check_server_reads(client, "It is sunny.", "It is sunny.", [])
    prompt = rendered(server, history(calls))
    assert f"<|tool>declaration:get_weather{{description:{Q}The weather in a city{Q}" in prompt     # the tools
    assert prompt.endswith("<|turn>model\n" + output.removeprefix("Checking.") +                      # the calls
                           f"<|tool_response>response:get_weather{{value:{Q}sunny, 21 C{Q}}}<tool_response|>"
                           f"<|tool_response>response:add{{value:{Q}sunny, 21 C{Q}}}<tool_response|>")   # the results
    turn = prompt.split("<|turn>model\n")[1].split("<|tool_response>")[0]
    assert calls_of(extract_tool_calls(auto("gemma4"), turn)) == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3.5})]
    check_forced_tool_choice(client)
