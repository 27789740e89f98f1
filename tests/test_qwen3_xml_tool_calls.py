"""Qwen3-Coder's / Qwen3.5's XML tool calls (--tool-call-parser qwen3_coder, qwen3_xml): the parser on crafted and
generated text, whole and cut into chunks anywhere, beside the qwen3 reasoning parser; then the real server on the
embedded SmolLM2 with a chat template whose few-shot turns the model copies, checked with the official `openai`
client, streamed and not."""
from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.output_processor import CompletionDelta
from kvflow.server.common.config import ServerConfig
from kvflow.server.serving.chunk_stream import chat_deltas
from kvflow.server.serving.qwen3_xml_tool_calls import ScanMemo, convert_value, scan_calls, xml_tool_call
from kvflow.server.serving.reasoning import SPLITTERS, ReasoningRequest
from kvflow.server.serving.tool_calls import (Qwen3XmlToolParser, ToolCallStreamer, extract_tool_calls,
                                              get_tool_parser, parse_tool_request)
from kvflow.server.testing import ServerThread
from test_tool_calls import stream_all
from tool_parser_checks import calls_of, chunked

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TYPED = {"type": "function", "function": {"name": "typed", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}, "maybe": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "e": {"enum": ["C", "F"]}, "t": {"type": ["integer", "null"]}}}}}
WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}}}}}
TOOLS = [WEATHER, TYPED, WRITE]


def call(name: str, *params: tuple[str, str], close: bool = True) -> str:
    """A call as Qwen3.5's template writes one: each tag and value on its own line."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}" + ("</function>\n</tool_call>" if close else "")


def auto(parser: str = "qwen3_xml", tools=TOOLS):
    return parse_tool_request(tools, "auto", tool_parser=parser)


def assert_streams_as_whole(request, text: str, seeds=range(4)) -> None:
    """Any chunking streams the whole response's calls, their arguments the same text, and its content."""
    whole = extract_tool_calls(request, text)
    for seed in seeds:
        content, streamed = stream_all(request, chunked(text, random.Random(seed)))
        assert [(c["name"], c["arguments"]) for c in streamed] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
        assert (content.strip() or None) == whole.content if whole.tool_calls else content == text


# ---------------------------------------------------------------------------------------------- whole and streamed
PARIS = call("get_weather", ("city", "Paris"), ("days", "3"))
CASES = [
    (PARIS, None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("Let me check both.\n\n" + PARIS + "\n" + call("get_weather", ("city", "Oslo")), "Let me check both.",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]),
    # Qwen3-Coder's compact spacing, no newlines around values
    ("<tool_call><function=get_weather><parameter=city>Rome</parameter><parameter=days>2</parameter></function>"
     "</tool_call>", None, [("get_weather", {"city": "Rome", "days": 2})]),
    # one newline either side is the format's; the rest is the value's
    (call("write_file", ("content", "\n  x = 1\n")), None, [("write_file", {"content": "\n  x = 1\n"})]),
    # tags inside a value that the structure does not follow stay in the value
    (call("write_file", ("path", "a.xml"), ("content", "<parameter=x>\n</parameter> done\n</function>!\n<b>")),
     None, [("write_file", {"path": "a.xml", "content": "<parameter=x>\n</parameter> done\n</function>!\n<b>"})]),
    # a missing </parameter>: the next declared parameter's line ends it, or </function>
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n<parameter=days>\n4\n</function>\n</tool_call>",
     None, [("get_weather", {"city": "Lima", "days": 4})]),
    # without <tool_call>, as vLLM reads it; a call left without </function> ends at its </tool_call>
    ("<function=get_weather>\n<parameter=city>\nBonn\n</parameter>\n</function>\n<tool_call>\n<function=get_weather>"
     "\n<parameter=city>\nKyiv\n</parameter>\n</tool_call>", None,
     [("get_weather", {"city": "Bonn"}), ("get_weather", {"city": "Kyiv"})]),
    # a parameter given twice: the first counts; one the schema does not declare: text
    (call("get_weather", ("city", "A"), ("city", "B"), ("extra", "42")), None,
     [("get_weather", {"city": "A", "extra": "42"})]),
    (call("get_weather"), None, [("get_weather", {})]),
    # unfinished (max_tokens): what there is, as vLLM reads it
    (call("get_weather", ("city", "Paris"), close=False) + "<parameter=days>\n1", None,
     [("get_weather", {"city": "Paris", "days": 1})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", None, [("get_weather", {"city": "Par"})]),
    ("<tool_call>\n<function=get_wea", "<tool_call>\n<function=get_wea", []),
    # no call: the text stays as the model wrote it
    ("The answer is 4.", "The answer is 4.", []),
    ("I use <tool_call> tags.\n", "I use <tool_call> tags.\n", []),
    ("<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>",
     "<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>", []),
    ("Use <tool_c", "Use <tool_c", []),
    ("", None, []),
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole_and_streamed(text, content, calls):
    request = auto()
    result = extract_tool_calls(request, text)
    assert (result.content, calls_of(result)) == (content, calls)
    assert len({c["id"] for c in result.tool_calls}) == len(calls)
    assert_streams_as_whole(request, text)


def test_qwen3_coder_is_the_same_parser():
    text = "Sure.\n" + PARIS
    assert extract_tool_calls(auto("qwen3_coder"), text).tool_calls[0]["function"] == extract_tool_calls(
        auto("qwen3_xml"), text).tool_calls[0]["function"]
    assert isinstance(get_tool_parser("qwen3_coder"), Qwen3XmlToolParser)
    assert ServerConfig(enable_auto_tool_choice=True, tool_call_parser="qwen3_coder").tool_call_parser == "qwen3_coder"


@pytest.mark.parametrize("param, raw, value", [
    ("s", "3", "3"), ("s", "null", "null"), ("s", "{'a': 1}", "{'a': 1}"),
    ("i", "42", 42), ("i", "-7", -7), ("i", "4.5", "4.5"), ("i", "many", "many"), ("i", "None", None),
    ("n", "2.5", 2.5), ("n", "3.0", 3), ("n", "1e3", 1000), ("n", "inf", "inf"), ("n", "x", "x"),
    ("b", "true", True), ("b", "True", True), ("b", "false", False), ("b", "yes", False),
    ("o", '{"k": [1, 2]}', {"k": [1, 2]}), ("o", "{'k': None}", {"k": None}), ("o", '"{\'k\': 1}"', {"k": 1}),
    ("o", "{broken", "{broken"), ("a", "[1, \"x\"]", [1, "x"]), ("a", "(1, 2)", [1, 2]), ("a", "{1, 2}", "{1, 2}"),
    ("maybe", "None", None), ("maybe", "text", "text"), ("e", "C", "C"), ("t", "null", None), ("t", "5", 5),
    ("undeclared", "5", "5"),
])
def test_values_take_the_schemas_types(param, raw, value):
    schema = TYPED["function"]["parameters"]["properties"].get(param)
    converted = json.loads(json.dumps(convert_value(raw, schema)))       # as the arguments carry it
    assert converted == value and type(converted) is type(value)
    text = call("typed", (param, raw))
    assert calls_of(extract_tool_calls(auto(), text)) == [("typed", {param: value})]
    assert_streams_as_whole(auto(), text, seeds=range(2))


def test_a_string_streams_as_it_is_written_and_other_types_once_complete():
    streamer = ToolCallStreamer(auto())
    text = call("typed", ("s", "abcdefgh"), ("i", "12345678"))
    fragments = [tc["function"]["arguments"] for ch in text for d in streamer.push(ch)
                 for tc in d.get("tool_calls", []) if "id" not in tc]
    assert fragments[:3] == ["{", '"s": "', "a"] and "".join(fragments[3:9]) == "bcdefg"
    assert any(f.startswith(', "i": 12345678') for f in fragments) and "1" not in fragments
    assert json.loads("".join(fragments)) == {"s": "abcdefgh", "i": 12345678}


# ---------------------------------------------------------------------------------------------- generated text
PIECES = ["a", "Z", " ", "\n", "\n\n", "<", ">", "/", '"', "\\", "é", "{", "}", "</parameter>x", "</function>x",
          "<parameter=undeclared>", "<tool_call>", "<function=f>", "</tool_call>", "<b>", "null"]


def generated_turn(rng: random.Random) -> tuple[str, list[tuple[str, dict]]]:
    """Prose, then calls of WRITE whose values are any text the format can carry, written by xml_tool_call."""
    calls = []
    for _ in range(rng.randint(1, 3)):
        args = {k: "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 8)))
                for k in rng.sample(["path", "content"], rng.randint(0, 2))}
        calls.append(("write_file", args))
    prose = rng.choice(["", "On it.\n\n", "Writing </x> now. "])
    return prose + "\n".join(xml_tool_call(n, a) for n, a in calls), calls


def test_generated_calls_round_trip_whole_and_streamed():
    rng = random.Random(7)
    for _ in range(150):
        text, calls = generated_turn(rng)
        assert calls_of(extract_tool_calls(auto(), text)) == calls, text
        assert_streams_as_whole(auto(), text, seeds=[rng.randrange(10**6)])


GARBAGE = ["<tool_call>", "</tool_call>", "<function=", "get_weather", "typed", ">", "</function>", "<parameter=",
           "city", "i", "o", "</parameter>", "\n", " ", "x", "{", "[1", "<", "</", "None", "{{ n }}"]


def test_every_prefix_only_adds_to_what_was_read():
    """The streamed text of content and arguments only grows, character by character, for well-formed and garbled
    output alike; the end (final) adds to it and is the whole response. A scan carried on from the last one (a
    stream's) reads what a fresh one does. Nothing raises."""
    rng = random.Random(3)
    texts = [c[0] for c in CASES] + [generated_turn(rng)[0] for _ in range(30)] + [
        "".join(rng.choice(GARBAGE) for _ in range(rng.randint(1, 40))) for _ in range(300)]
    functions = auto().functions
    for text in texts:
        before, memo = scan_calls("", functions), ScanMemo()
        for i in range(1, len(text) + 2):
            now = scan_calls(text[:i], functions) if i <= len(text) else scan_calls(text, functions, final=True)
            assert scan_calls(text[:i], functions, final=i > len(text), memo=memo) == now, text[:i]
            assert now.content.startswith(before.content), text[:i]
            assert len(now.calls) >= len(before.calls), text[:i]
            for old, new in zip(before.calls, now.calls):
                assert new.name == old.name and new.arguments.startswith(old.arguments), text[:i]
            before = now
        for c in before.calls:
            json.loads(c.arguments)
        assert [c.arguments for c in before.calls] == [
            c["function"]["arguments"] for c in extract_tool_calls(auto(), text).tool_calls]


# ---------------------------------------------------------------------------------------------- beside reasoning
def test_a_call_ends_qwen3_reasoning_unclosed():
    """Qwen3.5 may start a call without closing </think>: the qwen3 reasoning parser ends the reasoning at
    <tool_call><function and leaves the call to this parser, streamed (in any chunks) as whole."""
    text = "I should look it up.\n" + PARIS
    rng = random.Random(1)
    for _ in range(6):
        pieces = chunked(text, rng, most=20)
        splitter, streamer, reasoning, content, args = SPLITTERS["qwen3"](True), ToolCallStreamer(auto()), "", "", ""
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            deltas, finish = chat_deltas(CompletionDelta(0, piece, [i], finish_reason="stop" if last else None),
                                         streamer, splitter, ReasoningRequest("qwen3"))
            for d in deltas:
                reasoning += d.reasoning or ""
                content += d.content or ""
                args += "".join(tc["function"]["arguments"] for tc in d.tool_calls or [])
        assert (reasoning, content, finish) == ("I should look it up.\n", "", "tool_calls")
        assert json.loads(args) == {"city": "Paris", "days": 3} and streamer.names == ["get_weather"]
    thought, answer = SPLITTERS["qwen3"](True).split(text)
    assert thought == "I should look it up.\n" and calls_of(extract_tool_calls(auto(), answer)) == [
        ("get_weather", {"city": "Paris", "days": 3})]


# ---------------------------------------------------------------------------------------------- the server
# Three worked turns the 135M model copies: a question, `<think>` reasoning, then the calls in Qwen3.5's XML (one
# call left unclosed by </think>, as Qwen3.5 may write it; two calls after closed reasoning and a sentence).
ONE = "I call the tool.\n" + PARIS
TWO = ("I check both.\n</think>\n\nLet me check both.\n\n" + call("get_weather", ("city", "Paris")) + "\n"
       + call("get_weather", ("city", "Oslo"), ("days", "2")))
TEMPLATE = (
    "{%- set q = messages[-1]['content'] %}"
    "{%- set shot = " + json.dumps(TWO) + " if 'both' in q else " + json.dumps(ONE) + " %}"
    "{%- if tools %}{% for i in range(3) %}user: {{ q }}\nassistant: <think>\n{{ shot }}\n###\n{% endfor %}{% endif %}"
    "{%- for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{%- if add_generation_prompt %}assistant: <think>\n{% endif %}")
STOP = ["###"]


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(dtype="float32", max_model_len=1024, kv_cache_memory="128MiB", served_model_name="smol",
                          enforce_eager=True)
    with ServerThread(config, reasoning_parser="qwen3", chat_template=TEMPLATE, enable_auto_tool_choice=True,
                      tool_call_parser="qwen3_xml", trust_request_chat_template=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)


def streamed(client, **kw):
    """(reasoning, content, calls' (name, arguments text), finish reason) of a streamed chat, as a client adds
    the deltas up."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                name, args = calls.get(tc.index, ("", ""))
                calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
            finish = c.finish_reason or finish
    return reasoning or None, content or None, list(calls.values()), finish


@pytest.mark.slow
@pytest.mark.parametrize("question, reasoning, content, calls", [
    ("Weather in Paris?", "I call the tool.\n", None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("Weather in both?", "I check both.\n", "Let me check both.",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 2})]),
])
def test_the_server_returns_the_calls_whole_and_streamed(client, question, reasoning, content, calls):
    kw = dict(model="smol", messages=[{"role": "user", "content": question}], tools=[WEATHER], temperature=0,
              max_tokens=160, stop=STOP)
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert (message.model_extra["reasoning"], message.content, r.choices[0].finish_reason) == (
        reasoning, content, "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    got_reasoning, got_content, got_calls, finish = streamed(client, **kw)
    assert (got_reasoning, (got_content or "").strip() or None, finish) == (reasoning, content, "tool_calls")
    assert got_calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]


@pytest.mark.slow
def test_a_template_without_tools_gets_the_format_from_the_server(server):
    """A template that cannot express tools: the server's system message teaches the XML syntax and an earlier
    call is written back in it."""
    earlier = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 2})}}]}
    body = {"model": "smol", "tools": [WEATHER], "chat_template": "{% for m in messages %}{{ m['content'] }}\n"
            "{% endfor %}", "messages": [{"role": "user", "content": "Weather?"}, earlier,
                                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}
    ids = httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", json={"model": "smol", "tokens": ids}, timeout=60).json()["prompt"]
    assert "<function=NAME>" in prompt and '"name": "get_weather"' in prompt
    assert xml_tool_call("get_weather", {"city": "Oslo", "days": 2}) in prompt
    assert calls_of(extract_tool_calls(auto(tools=[WEATHER]), prompt.split("sunny")[0].split("Weather?")[-1])) == [
        ("get_weather", {"city": "Oslo", "days": 2})]
