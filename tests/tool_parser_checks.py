"""What the tool-call parser tests share: a parser's whole reading against its stream cut anywhere, and a real server
on a tiny model whose template renders a model's documented prompt format (tests/chat_templates/*_format.jinja,
written for these tests, not the models' own files), where the model's output is forced with a structured-output
`choice` (so a random-weight model writes exactly the text a real model would) under tool_choice "auto", for the
parser to read."""
from __future__ import annotations

import json
import random
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai

from kvflow.config import EngineConfig
from kvflow.server.serving.tool_calls import ToolCallStreamer, extract_tool_calls, parse_tool_request
from kvflow.server.testing import ServerThread
from tiny_models import SMOLLM2_VOCAB, make_tiny_hf_model

TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]


def auto(parser: str, tools=TOOLS):
    return parse_tool_request(tools, "auto", tool_parser=parser)


def calls_of(extracted) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in extracted.tool_calls]


def chunked(text: str, rng: random.Random, most: int = 14) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, most)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def stream(request, pieces) -> tuple[str, list[dict]]:
    """Feed text pieces to a streamer; rebuild content and the calls (id, name, arguments) as a client would. Each
    call's first chunk announces it whole (index, id, type, name, arguments ""), later ones only add arguments."""
    streamer, content, calls = ToolCallStreamer(request), "", {}
    for delta in [d for p in pieces for d in streamer.push(p)] + streamer.finish():
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function" and tc["function"]["arguments"] == ""
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert streamer.has_tool_calls == bool(calls)
    return content, [calls[i] for i in range(len(calls))]


def check_whole_and_streamed(request, text: str, content: str | None, calls: list[tuple[str, dict]],
                             seeds=range(4)) -> list[dict]:
    """The whole reading is (content, calls); the stream, cut anywhere (and character by character), sends the same
    calls (arguments the same JSON value) and the content before them (all of the text when there are none).
    Returns the whole reading's tool_calls."""
    whole = extract_tool_calls(request, text)
    assert (whole.content, calls_of(whole)) == (content, calls), text
    assert len({c["id"] for c in whole.tool_calls}) == len(calls)
    cuts = [list(text)] + [chunked(text, random.Random(seed)) for seed in seeds]
    for pieces in cuts:
        got_content, streamed = stream(request, pieces)
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls, (text, pieces)
        if calls:
            assert got_content.strip() == (content or "").strip(), (text, pieces)
        else:
            assert got_content == text, (text, pieces)
    return whole.tool_calls


def check_prefixes_grow(parser, text: str) -> None:
    """A parser's reading of each prefix of `text` only adds to the last one's (content and each call's arguments),
    and the end's reading (final) adds to the last prefix's. Nothing raises."""
    before_content, before_calls = "", []
    for i in range(len(text) + 2):
        content, calls = parser.partial(text[:i], final=i > len(text))
        assert content.startswith(before_content), (text[:i], content)
        announced = [c for c in calls if c.name is not None]
        assert len(announced) >= len(before_calls), text[:i]
        for old, new in zip(before_calls, announced):
            assert new.name == old.name and new.arguments.startswith(old.arguments), (text[:i], old, new)
        before_content, before_calls = content, announced


# ---------------------------------------------------------------------------------------------- the server
@contextmanager
def tool_server(directory: Path, parser: str, template: str, special_tokens: tuple[str, ...] = ()):
    """A tiny random-weight llama on the SmolLM2 tokenizer, served with --enable-auto-tool-choice --tool-call-parser
    `parser` and the chat template in tests/chat_templates/`template`. `special_tokens`: added to the tokenizer as
    special tokens (ids from SMOLLM2_VOCAB on, in order; the model's vocabulary grows to hold them), as a model's
    markers are in its own tokenizer."""
    path = make_tiny_hf_model(directory, family="llama", seed=3, max_position_embeddings=2048,
                              vocab_size=SMOLLM2_VOCAB + len(special_tokens))
    if special_tokens:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
        assert tokenizer.convert_tokens_to_ids(list(special_tokens)) == [SMOLLM2_VOCAB + i for i in range(len(
            special_tokens))]
        tokenizer.save_pretrained(path)
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=2048, kv_cache_memory="16MiB",
                          served_model_name="tiny", enforce_eager=True)
    with ServerThread(config, chat_template=str(TEMPLATES / template), enable_auto_tool_choice=True,
                      tool_call_parser=parser) as server:
        yield server


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)


def forced(client, output: str, messages=None, stream: bool = False, **kw):
    """A chat under tool_choice "auto" whose output is forced to be `output` (a structured-output choice)."""
    return client.chat.completions.create(
        model="tiny", messages=messages or [{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS, temperature=0, max_tokens=300, stream=stream,
        extra_body={"structured_outputs": {"choice": [output]}}, **kw)


def streamed(chunks) -> tuple[str | None, list[tuple[str, str, str]], str | None]:
    """(content, calls' (id, name, arguments text), finish reason) of a streamed chat, as a client adds them up."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                got = calls.setdefault(tc.index, ["", "", ""])
                got[0] += tc.id or ""
                got[1] += tc.function.name or ""
                got[2] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in range(len(calls))], finish


def check_server_reads(client, output: str, content: str | None, calls: list[tuple[str, dict]]) -> list:
    """The server reads the forced `output` into (content, calls), whole and streamed; returns the whole response's
    tool_calls (openai objects)."""
    r = forced(client, output)
    message, finish = r.choices[0].message, r.choices[0].finish_reason
    assert finish == ("tool_calls" if calls else "stop")
    assert message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == calls
    got_content, got_calls, got_finish = streamed(forced(client, output, stream=True))
    assert got_finish == finish
    assert [(name, json.loads(args)) for _, name, args in got_calls] == calls
    assert (got_content or "").strip() == (content or "").strip() if calls else got_content == output
    return message.tool_calls or []


def check_forced_tool_choice(client) -> None:
    """tool_choice "required" and a named function still go through the grammar on a server with this parser (the
    schema bounded, so that a random-weight model ends within max_tokens)."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}]
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Add 2 and 3."}],
                                           tools=tools, tool_choice=choice, parallel_tool_calls=False, temperature=0,
                                           max_tokens=100)
        call, = r.choices[0].message.tool_calls
        assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}


def rendered(server, messages: list[dict], tools=TOOLS) -> str:
    """The prompt the chat route renders for these messages (its template, tools and all), as text."""
    body = {"model": "tiny", "messages": messages, "tools": tools}
    r = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    prompt = httpx.post(server.url + "/detokenize", json={"model": "tiny", "tokens": r.json()["tokens"]}, timeout=60)
    return prompt.json()["prompt"]


def history(calls, question: str = "What is the weather in Paris?", result: str = "sunny, 21 C") -> list[dict]:
    """A user turn, the assistant's tool calls (openai objects from a response) and a tool result for each."""
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in calls]}
    return [{"role": "user", "content": question}, turn] + [
        {"role": "tool", "tool_call_id": c.id, "content": result} for c in calls]
