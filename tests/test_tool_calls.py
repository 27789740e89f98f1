"""Tool calling helpers (kvflow.server.serving.tool_calls): validation, forced calls through the real grammar, parsers."""
import json
import random

import jsonschema
import pytest

from kvflow.errors import InvalidRequestError
from kvflow.structured_output import GrammarCompiler
from kvflow.server.serving.tool_calls import (ToolCallStreamer, extract_tool_calls, get_tool_parser, parse_tool_request,
                               template_supports_tools)
from test_structured_output import gen_object_schema, one_torch_thread, sample_constrained  # noqa: F401

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "ping"}}]          # no parameters: an empty object


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    c = GrammarCompiler(smollm2_tokenizer)
    yield c
    c.close()


def stream_all(request, pieces):
    """Feed text pieces to a streamer; rebuild content and the calls from the deltas as a client would."""
    streamer, content, calls = ToolCallStreamer(request), "", {}
    for delta in [d for p in pieces for d in streamer.push(p)] + streamer.finish():
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            if "id" in tc:   # the first chunk of a call announces it completely
                assert tc["index"] == len(calls) and tc["type"] == "function" and tc["function"]["arguments"] == ""
                assert tc["id"].startswith("call_")
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert streamer.has_tool_calls == bool(calls)
    return content, [calls[i] for i in range(len(calls))]


def token_pieces(tokenizer, out):
    """The text as a detokenizer hands it out: one piece per token, held while a character is split."""
    pieces, sent = [], ""
    for i in range(len(out)):
        text = tokenizer.decode(out[: i + 1])
        if not text.endswith("\ufffd") or i + 1 == len(out):
            pieces.append(text[len(sent):])
            sent = text
    return pieces


def same_calls(streamed, extracted):
    assert [c["name"] for c in streamed] == [c["function"]["name"] for c in extracted]
    assert [json.loads(c["arguments"]) for c in streamed] == [json.loads(c["function"]["arguments"]) for c in extracted]


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("tools, choice, param", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([], {"type": "function", "function": {"name": "add"}}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, "auto", "tool_choice"),    # the server was started without a parser
    ({"type": "function"}, None, "tools"),
    ([{"type": "retrieval"}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "has space"}}], "required", "tools[0].function.name"),
    (TOOLS + [TOOLS[0]], "required", "tools[3].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "required", "tools[0].function.parameters"),
])
def test_bad_tools_and_tool_choice_name_the_field(tools, choice, param):
    with pytest.raises(InvalidRequestError) as e:
        parse_tool_request(tools, choice)
    assert e.value.param == param


def test_tool_choice_modes():
    assert parse_tool_request(None) is None and parse_tool_request([], "none") is None
    assert parse_tool_request(TOOLS, "none").spec() is None
    auto = parse_tool_request(TOOLS, tool_parser="hermes")
    assert (auto.mode, auto.parser, auto.spec()) == ("auto", "hermes", None)
    named = parse_tool_request(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert (named.mode, named.name) == ("function", "add")
    assert json.loads(named.spec().payload) == TOOLS[1]["function"]["parameters"]
    required = parse_tool_request(TOOLS, "required").spec()
    assert json.loads(required.payload)["minItems"] == 1 and required.param == "tools"
    with pytest.raises(InvalidRequestError) as e:
        parse_tool_request(TOOLS, "auto", tool_parser="mistral-ish")
    assert e.value.param == "tool_call_parser"


def test_template_support(smollm2_tokenizer):
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_supports_tools(None) and not template_supports_tools("{{ messages }}")
    assert isinstance(template_supports_tools(smollm2_tokenizer.chat_template), bool)


# ---------------------------------------------------------------------------------------------- forced calls
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                    {"type": "function", "function": {"name": "ping"}}])
def test_forced_calls_validate_streamed_and_not(compiler, smollm2_tokenizer, choice):
    request = parse_tool_request(TOOLS, choice)
    compiled = compiler.compile(request.spec())
    params = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
    for seed in range(4):
        m = compiled.matcher()
        out, = sample_constrained(smollm2_tokenizer, [m], seed=seed)
        assert m.is_terminated()
        text = smollm2_tokenizer.decode(out)
        result = extract_tool_calls(request, text)
        assert result.content is None and result.tool_calls
        for call in result.tool_calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), params[call["function"]["name"]])
        content, streamed = stream_all(request, token_pieces(smollm2_tokenizer, out))
        assert content == "" and same_calls(streamed, result.tool_calls) is None


@pytest.mark.slow
def test_required_with_generated_parameter_schemas(compiler, smollm2_tokenizer):
    rng = random.Random(5)
    tools = [{"type": "function", "function": {"name": f"fn_{i}", "parameters": gen_object_schema(rng)}} for i in range(6)]
    request = parse_tool_request(tools, "required")
    matchers = [compiler.compile(request.spec()).matcher() for _ in range(8)]
    for m, out in zip(matchers, sample_constrained(smollm2_tokenizer, matchers, seed=11)):
        assert m.is_terminated()
        for call in extract_tool_calls(request, smollm2_tokenizer.decode(out)).tool_calls:
            schema = tools[int(call["function"]["name"].split("_")[1])]["function"]["parameters"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


# ---------------------------------------------------------------------------------------------- auto parsers
CALLS = [("get_weather", {"city": "Paris", "unit": "C"}), ("add", {"a": 1, "b": 41}), ("ping", {})]


def hermes_text(calls, before="", after=""):
    blocks = "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)
    return before + blocks + after


@pytest.mark.parametrize("text, content, calls", [
    (hermes_text(CALLS[:1]), None, CALLS[:1]),
    (hermes_text(CALLS, before="Let me look that up.\n"), "Let me look that up.", CALLS),
    ('<tool_call>{"arguments": {"a": 2, "b": 3}, "name": "add"}</tool_call>', None, [("add", {"a": 2, "b": 3})]),
    ('<tool_call>\n{"name": "ping", "arguments": {}}', None, [("ping", {})]),      # EOS before the close tag
    ("The answer is 4.", "The answer is 4.", []),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("Use <tool_c", "Use <tool_c", []),
])
def test_hermes_parser_round_trip(text, content, calls):
    request = parse_tool_request(TOOLS, "auto", tool_parser="hermes")
    result = extract_tool_calls(request, text)
    assert result.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls] == calls
    assert len({c["id"] for c in result.tool_calls}) == len(calls)
    rng = random.Random(0)
    for _ in range(3):   # any chunking of the stream gives the same calls
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        streamed_content, streamed = stream_all(request, pieces)
        same_calls(streamed, result.tool_calls)
        assert streamed_content.strip() == (content or "")


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ('[{"name": "ping", "arguments": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]', None,
     [("ping", {}), ("get_weather", {"city": "Oslo"})]),
    ('```json\n{"name": "ping", "arguments": {}}\n```', None, [("ping", {})]),
    ("Sunny, 21 C.", "Sunny, 21 C.", []),
    ('{"answer": 42}', '{"answer": 42}', []),
])
def test_json_parser_round_trip(text, content, calls):
    request = parse_tool_request(TOOLS, "auto", tool_parser="json")
    result = extract_tool_calls(request, text)
    assert result.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls] == calls
    streamed_content, streamed = stream_all(request, list(text))
    same_calls(streamed, result.tool_calls)
    assert streamed_content == ("" if calls else text)


def test_arguments_stream_in_fragments():
    request = parse_tool_request(TOOLS, "auto", tool_parser="hermes")
    streamer = ToolCallStreamer(request)
    deltas = [d for ch in hermes_text(CALLS[:1]) for d in streamer.push(ch)]
    fragments = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
    assert len(fragments) > 5 and json.loads("".join(fragments)) == CALLS[0][1]
    assert get_tool_parser("json") and get_tool_parser("hermes")


def test_the_config_names_every_parser():
    """--tool-call-parser's choices (ServerConfig, below the chat route) are the parsers tool_calls.py implements."""
    from kvflow.server.common import config
    from kvflow.server.serving.tool_calls import TOOL_PARSERS
    assert tuple(TOOL_PARSERS) == config.TOOL_PARSERS
