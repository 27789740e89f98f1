"""Pythonic tool calls (--tool-call-parser pythonic): the parser on crafted text, whole and cut into chunks anywhere;
then the real server with a template in Llama 3.2's documented pythonic tool-calling format, the output forced under
"auto"."""
from __future__ import annotations

import json

import pytest

from kvflow.server.serving.pythonic_tool_calls import PythonicToolParser, written
from kvflow.server.serving.tool_calls import ToolCallStreamer, extract_tool_calls
from tool_parser_checks import (auto, calls_of, check_forced_tool_choice, check_prefixes_grow, check_server_reads,
                                check_whole_and_streamed, client_of, history, rendered, tool_server)

PARIS = '[get_weather(city="Paris", days=3)]'
UNFINISHED = "[get_weather(city='Par"
REPEATED = "[f(a=1, a=2)]"             # a flaw after the call was announced: a stream has sent it
CASES = [
    (PARIS, None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("  [get_weather(city='Oslo'), add(a=1, b=-2.5)]\n", None,
     [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": -2.5})]),
    ("<|python_start|>[add(a=1,b=2)]<|python_end|>", None, [("add", {"a": 1, "b": 2})]),
    # literals of every kind; brackets, quotes and commas inside strings; a trailing comma
    ('[f(s="a, (b) ]", t=\'it\\\'s\', u="""x\ny""", n=None, yes=True, no=False, l=[1, (2, 3)], '
     'd={"k": {"j": [None]}},)]', None,
     [("f", {"s": "a, (b) ]", "t": "it's", "u": "x\ny", "n": None, "yes": True, "no": False, "l": [1, [2, 3]],
             "d": {"k": {"j": [None]}}})]),
    ("[ping()]", None, [("ping", {})]),
    ('[get_weather(city="Paris")]\nLet me know.', None, [("get_weather", {"city": "Paris"})]),   # after: dropped
    # not calls: content as written
    ("The weather is sunny.", "The weather is sunny.", []),
    ("[1] A footnote.", "[1] A footnote.", []),
    ("[Paris](https://example.com)", "[Paris](https://example.com)", []),
    ("[]", "[]", []),
    ('[get_weather("Paris")]', '[get_weather("Paris")]', []),                 # positional
    ("[get_weather(city=Paris)]", "[get_weather(city=Paris)]", []),           # a name, no literal
    ("[get_weather(city=open('x').read())]", "[get_weather(city=open('x').read())]", []),   # never evaluated
    (REPEATED, REPEATED, []),
    ("[f(a=1]", "[f(a=1]", []),
    ("[f(a=float('nan'))]", "[f(a=float('nan'))]", []),
    (UNFINISHED, UNFINISHED, []),          # unfinished (max_tokens): content, as vLLM's whole reading has it
    ("", None, []),
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole(text, content, calls):
    result = extract_tool_calls(auto("pythonic"), text)
    assert (result.content, calls_of(result)) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [c for c in CASES if c[0] not in (UNFINISHED, REPEATED)])
def test_streamed_as_whole(text, content, calls):
    tool_calls = check_whole_and_streamed(auto("pythonic"), text, content, calls)
    check_whole_and_streamed(auto("llama4_pythonic"), text, content, calls, seeds=range(1))   # vLLM's Llama 4 name
    for call in tool_calls:          # the arguments are JSON as json.dumps writes it
        assert call["function"]["arguments"] == json.dumps(json.loads(call["function"]["arguments"]),
                                                           ensure_ascii=False)


@pytest.mark.parametrize("text", [c[0] for c in CASES if c[0] != REPEATED] + [
    '[f(a=1), g(b="x, y"), h(c={"d": [1, 2]})]', "[f(a=1)", "<|python_start|>[f(", "[f(a='''x)"])
def test_every_prefix_only_adds(text):
    check_prefixes_grow(PythonicToolParser(), text)


def test_arguments_stream_one_at_a_time():
    streamer = ToolCallStreamer(auto("pythonic"))
    deltas = [d for ch in '[add(a=1, b=2), ping()]' for d in streamer.push(ch)] + streamer.finish()
    fragments = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
    assert fragments == ['{"a": 1', ', "b": 2}', "{}"]
    assert streamer.names == ["add", "ping"]


def test_written_calls_read_back():
    calls = [{"name": "get_weather", "arguments": {"city": "O'slo", "days": 2}},
             {"name": "add", "arguments": {"a": 1.5, "b": None, "c": [True, {"x": "y"}]}}]
    assert calls_of(extract_tool_calls(auto("pythonic"), written(calls))) == [
        (c["name"], c["arguments"]) for c in calls]


def test_a_template_without_tools_is_taught_the_format():
    from kvflow.server.serving.tool_prompt import tools_system_prompt
    assert "Python list of calls" in tools_system_prompt(auto("pythonic"))


# ---------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tool_server(tmp_path_factory.mktemp("tiny-pythonic"), "pythonic", "llama3_pythonic_format.jinja") as s:
        yield s


@pytest.mark.slow
def test_the_server_reads_pythonic_calls_and_the_template_writes_them_back(server):
    """The template in Llama 3.2's pythonic format renders the tools, the server's calls (as the model wrote them)
    and their results; the parser reads the calls the template wrote back as the same calls."""
    client = client_of(server)
    output = '[get_weather(city="Paris"), add(a=2, b=3.5)]'
    calls = check_server_reads(client, output, None, [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3.5})])
    check_server_reads(client, "[1] Sunny.", "[1] Sunny.", [])
    prompt = rendered(server, history(calls))
    assert "You can call these functions (given as JSON)" in prompt and '"name": "add"' in prompt   # the tools
    assert '<|start_header_id|>assistant<|end_header_id|>\n\n[get_weather(city="Paris"), add(a=2, b=3.5)]<|eot_id|>' \
        in prompt                                                                               # the calls
    assert prompt.count("<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 21 C<|eot_id|>") == 2   # the results
    turn = prompt.split("<|start_header_id|>assistant<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
    assert calls_of(extract_tool_calls(auto("pythonic"), turn)) == [("get_weather", {"city": "Paris"}),
                                                                    ("add", {"a": 2, "b": 3.5})]
    check_forced_tool_choice(client)
