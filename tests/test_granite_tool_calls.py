"""Granite 3.x's tool calls (--tool-call-parser granite): the parser on crafted text, whole and cut into chunks
anywhere; then the real server with a template in Granite 3.0's documented format, the output forced under
"auto"."""
from __future__ import annotations

import pytest

from kvflow.server.serving.granite_tool_calls import GraniteToolParser, written
from kvflow.server.serving.tool_calls import extract_tool_calls
from tool_parser_checks import (auto, calls_of, check_forced_tool_choice, check_prefixes_grow, check_server_reads,
                                check_whole_and_streamed, client_of, history, rendered, tool_server)

PARIS = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
UNFINISHED = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa'
NO_ARGUMENTS = '<|tool_call|>[{"name": "ping"}]'    # not a call (vLLM's reading), found after it was announced
CASES = [
    ("<|tool_call|>" + PARIS, None, [("get_weather", {"city": "Paris"})]),
    ("<tool_call>" + PARIS, None, [("get_weather", {"city": "Paris"})]),                 # Granite 3.1 on
    (" \n" + PARIS + "\n", None, [("get_weather", {"city": "Paris"})]),                  # the token skipped
    ('<|tool_call|> <tool_call> [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, {"name": "add", '
     '"arguments": {"a": 1, "b": 2}}]', None,
     [("get_weather", {"city": "Oslo", "days": 2}), ("add", {"a": 1, "b": 2})]),
    ('<|tool_call|>[{"arguments": {}, "name": "ping"}]</tool_call>', None, [("ping", {})]),   # after: dropped
    # not calls: content as written
    ("The weather is sunny.", "The weather is sunny.", []),
    ("<|tool_call|>" + PARIS[1:-1], "<|tool_call|>" + PARIS[1:-1], []),                  # an object, not a list
    (NO_ARGUMENTS, NO_ARGUMENTS, []),
    ("<|tool_call|>[]", "<|tool_call|>[]", []),
    ("Sure: " + PARIS, "Sure: " + PARIS, []),
    ("<tool_ca", "<tool_ca", []),
    (UNFINISHED, UNFINISHED, []),    # unfinished (max_tokens): content, as vLLM's whole reading has it
    ("", None, []),
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole(text, content, calls):
    result = extract_tool_calls(auto("granite"), text)
    assert (result.content, calls_of(result)) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [c for c in CASES if c[0] not in (UNFINISHED, NO_ARGUMENTS)])
def test_streamed_as_whole(text, content, calls):
    check_whole_and_streamed(auto("granite"), text, content, calls)


@pytest.mark.parametrize("text", [c[0] for c in CASES if c[0] != NO_ARGUMENTS] + ["<|tool_call|><tool_call>[{"])
def test_every_prefix_only_adds(text):
    check_prefixes_grow(GraniteToolParser(), text)


def test_written_calls_read_back():
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert calls_of(extract_tool_calls(auto("granite"), written(calls))) == [(c["name"], c["arguments"]) for c in calls]
    from kvflow.server.serving.tool_prompt import tools_system_prompt
    assert "<|tool_call|>[" in tools_system_prompt(auto("granite"))


# ---------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tool_server(tmp_path_factory.mktemp("tiny-granite"), "granite", "granite_format.jinja") as s:
        yield s


@pytest.mark.slow
def test_the_server_reads_granite_calls_and_the_template_writes_them_back(server):
    """The template in Granite's format renders the tools, the server's calls (as the model wrote them) and their
    results; the parser reads the calls the template wrote back as the same calls."""
    client = client_of(server)
    output = ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "add", "arguments": {"a": 2, "b": 3}}]')
    calls = check_server_reads(client, output, None, [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})])
    check_server_reads(client, "It is sunny.", "It is sunny.", [])
    prompt = rendered(server, history(calls))
    assert '<|start_of_role|>available_tools<|end_of_role|>\n{\n    "type": "function"' in prompt   # the tools
    assert ('<|start_of_role|>assistant<|end_of_role|><|tool_call|>[{"name": "get_weather", "arguments": {"city": '
            '"Paris"}}, {"name": "add", "arguments": {"a": 2, "b": 3}}]<|end_of_text|>') in prompt    # the calls
    assert prompt.count("<|start_of_role|>tool_response<|end_of_role|>sunny, 21 C<|end_of_text|>") == 2
    turn = prompt.split("<|start_of_role|>assistant<|end_of_role|>")[1].split("<|end_of_text|>")[0]
    assert calls_of(extract_tool_calls(auto("granite"), turn)) == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})]
    check_forced_tool_choice(client)
