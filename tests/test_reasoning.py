"""Reasoning output (--reasoning-parser): the splitters on crafted text cut at every place, then the real server on the
embedded SmolLM2 with a chat template whose few-shot turns the model copies (`<think>...</think>` and then an answer,
or a tool call), checked with the official `openai` and `anthropic` clients, streamed and not, on the chat, Responses
and Messages APIs."""
from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from kvflow.async_engine import CompletionDelta
from kvflow.config import EngineConfig
from kvflow.server.common.errors import APIError
from kvflow.server.serving.protocol import ChatCompletionRequest
from kvflow.server.serving.serving import OpenAIServing
from kvflow.server.common.config import REASONING_PARSERS, ServerConfig
from kvflow.server.serving.reasoning import SPLITTERS, reasoning_request, reasoning_tokens
from kvflow.server.testing import ServerThread
from test_server_handlers import FakeEngine, FakeTokenizer

# ---------------------------------------------------------------------------------------------- the splitters
# (parser, output, in_reasoning) -> (reasoning, answer)
CASES = [
    ("deepseek_r1", "<think>I add.</think>\n\nThe answer is 4.", True, ("I add.", "\n\nThe answer is 4.")),
    ("deepseek_r1", "I add.</think>The answer", True, ("I add.", "The answer")),      # no opening tag
    ("deepseek_r1", "I add and add", True, ("I add and add", "")),                      # cut: all reasoning
    ("deepseek_r1", "x<think>y</think>z<think>w</think>", True, ("xy", "z<think>w</think>")),
    ("deepseek_r1", "</think>only", True, ("", "only")),
    ("deepseek_r1", "a </thin", True, ("a </thin", "")),                                # a marker cut short
    ("deepseek_r1", "<think>a</think>b", False, ("", "<think>a</think>b")),              # the prompt closed it
    ("qwen3", "<think>I add.</think>The answer", True, ("I add.", "The answer")),
    ("qwen3", "plan <tool_call>\n<function=f>\n</function>\n</tool_call>", True,
     ("plan ", "<tool_call>\n<function=f>\n</function>\n</tool_call>")),                # Qwen3.5's implicit end
    ("qwen3", 'a <tool_call>{"name": 1} b</think>c', True, ('a <tool_call>{"name": 1} b', "c")),
    ("qwen3", "The answer </think> x", False, ("", "The answer </think> x")),
    ("granite", "Here is my thought process: I add. Here is my response: 4", True, (" I add. ", " 4")),
    ("granite", "Here's my thought process:\nI add.\nHere's my response:\n4", True, ("\nI add.\n", "\n4")),
    ("granite", "Here is my thought process: I add.", True, (" I add.", "")),
    ("granite", "Hello there. Here is my response: 4", True, ("", "Hello there. Here is my response: 4")),
    ("granite", "Here is", True, ("", "Here is")),
]


def run(parser: str, chunks: list[str], in_reasoning: bool):
    splitter = SPLITTERS[parser](in_reasoning)
    reasoning = content = ""
    for piece in [*(splitter.push(c) for c in chunks), splitter.finish()]:
        reasoning, content = reasoning + piece[0], content + piece[1]
    return reasoning, content, splitter.reasoning_end, splitter.has_reasoning


def test_the_parsers_are_the_flags_choices():
    assert sorted(SPLITTERS) == sorted(REASONING_PARSERS)


@pytest.mark.parametrize("parser,text,in_reasoning,expected", CASES)
def test_splitter_cuts_streamed_text_where_it_cuts_the_whole(parser, text, in_reasoning, expected):
    """Every split of the text into three chunks gives the parts the whole text gives, and those are the expected
    ones: a marker split over chunks (tokens) is found all the same."""
    whole = run(parser, [text], in_reasoning)
    assert whole[:2] == expected
    assert SPLITTERS[parser](in_reasoning).split(text) == expected
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert run(parser, [text[:i], text[i:j], text[j:]], in_reasoning) == whole, (i, j)
    per_char = run(parser, list(text), in_reasoning)
    assert per_char == whole


def test_reasoning_end_and_token_count():
    text = "<think>ab</think>cd"
    splitter = SPLITTERS["deepseek_r1"]()
    splitter.split(text)
    assert splitter.reasoning_end == len("<think>ab</think>")
    chars = list(text)                            # one "token" per character
    assert reasoning_tokens(splitter, list(range(len(chars))), lambda ids: "".join(chars[i] for i in ids)) == 17
    never = SPLITTERS["deepseek_r1"]()
    never.split("abc")
    assert reasoning_tokens(never, [1, 2, 3], lambda ids: "") == 3
    none = SPLITTERS["granite"]()
    none.split("Hello")
    assert reasoning_tokens(none, [1, 2, 3], lambda ids: "") == 0


def test_thinking_switches():
    """qwen3 reads enable_thinking; every parser starts in the answer when the prompt closed the reasoning."""
    assert not reasoning_request("qwen3", {"enable_thinking": False}, "user: hi\n").in_reasoning
    assert reasoning_request("qwen3", {}, "user: hi\n<think>\n").in_reasoning
    assert reasoning_request("deepseek_r1", {"enable_thinking": False}, "hi").in_reasoning   # R1 has no switch
    assert not reasoning_request("deepseek_r1", {}, "hi<think>\n\n</think>\n\n").in_reasoning
    assert reasoning_request("deepseek_r1", {}, "old </think> turn, then <think>").in_reasoning
    # a tool loop: the reasoning of the turn before the tool's answer closed that turn, not the reply's
    assert reasoning_request("qwen3", {}, "<think>\nR\n</think>\n\n<tool_call>{}</tool_call><|im_end|>\n"
                                          "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n").in_reasoning
    assert not reasoning_request("granite", {}, "Here is my thought process: x Here is my response:").in_reasoning


def test_unknown_parser_is_refused_at_start_naming_the_flag(capsys):
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ServerConfig(reasoning_parser="deepseek")
    from kvflow.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "deepseek"])
    assert "--reasoning-parser" in capsys.readouterr().err


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert ServerConfig(chat_template=str(path)).chat_template_text() == "{{ messages[0]['content'] }}"
    assert ServerConfig(chat_template="{{ 'x' }}").chat_template_text() == "{{ 'x' }}"
    with pytest.raises(ValueError, match="--chat-template"):
        ServerConfig(chat_template=str(tmp_path / "missing.jinja"))


# ---------------------------------------------------------------------------------------------- the serving seam
PIECES = ["<th", "ink>I a", "dd.</", "think", ">", "\n\nFo", "ur."]       # token i's text: PIECES[i]


class PieceTokenizer(FakeTokenizer):
    def decode(self, ids, skip_special_tokens=True):
        return "".join(PIECES[i] for i in ids)


class PieceStream:
    """One choice that writes PIECES, a token a delta."""
    def __init__(self, params, prompt):
        self.params, self.num_prompt_tokens, self.num_cached_tokens = params, len(prompt), 0
        self.num_completion_tokens = 0

    async def _deltas(self):
        for i, piece in enumerate(PIECES):
            self.num_completion_tokens += 1
            yield CompletionDelta(0, piece, [i], None, "stop" if i == len(PIECES) - 1 else None, None)

    def __aiter__(self):
        return self._deltas()

    def close(self):
        pass


class PieceEngine(FakeEngine):
    tokenizer = PieceTokenizer()

    def submit(self, request):
        return PieceStream(request.params, request.prompt_token_ids)


async def streamed_chunks(serving: OpenAIServing, **body) -> list[dict]:
    streamed = await serving.chat(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True,
                                                        **body))
    return [json.loads(c[6:]) async for c in streamed.body_iterator if c.startswith("data: {")]


async def whole_and_streamed(serving: OpenAIServing, **body):
    whole = (await serving.chat(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)))
    return whole.model_dump(), await streamed_chunks(serving, **body)


def test_without_a_parser_the_markers_stay_in_the_content():
    whole, chunks = asyncio.run(whole_and_streamed(OpenAIServing(PieceEngine())))
    message = whole["choices"][0]["message"]
    assert message["content"] == "".join(PIECES) and message["reasoning"] is None
    assert "completion_tokens_details" not in whole["usage"]
    assert all("reasoning" not in c["delta"] for chunk in chunks for c in chunk["choices"])
    with pytest.raises(APIError) as e:        # nothing would be split off: the field would mean nothing
        asyncio.run(OpenAIServing(PieceEngine()).chat(ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}], include_reasoning=False)))
    assert e.value.param == "include_reasoning"


def test_the_seam_splits_a_marker_spread_over_tokens_alike_whole_and_streamed():
    whole, chunks = asyncio.run(whole_and_streamed(OpenAIServing(PieceEngine(), reasoning_parser="deepseek_r1")))
    message = whole["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == ("I add.", "I add.",
                                                                                        "\n\nFour.")
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}    # up to the token ending ">"
    deltas = [c["delta"] for chunk in chunks for c in chunk["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "I add."
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nFour."
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)

    # continuous usage: every token so far while it reasons, then the final count
    chunks = asyncio.run(streamed_chunks(OpenAIServing(PieceEngine(), reasoning_parser="deepseek_r1"),
                                         stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [(c["usage"]["completion_tokens"], c["usage"]["completion_tokens_details"]["reasoning_tokens"])
              for c in chunks if c["choices"]]
    assert counts[-1] == (7, 5) and all(r == n for n, r in counts if n <= 4), counts


# ---------------------------------------------------------------------------------------------- the server
# A template the 135M model copies from: three worked turns, then the conversation and `<think>` (the generation
# prompt of R1-0528 and Qwen3.5 opens the reasoning); an earlier assistant turn's reasoning goes between think markers,
# as Qwen3's template writes it. With tools, the turns call a tool. enable_thinking=false writes
# an empty `<think></think>`, as Qwen3's template does: the prompt closes the reasoning.
TEMPLATE = (
    "{%- if tools %}{% set shot = '<think>I call the tool.</think><tool_call>"
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>' %}"
    "{%- else %}{% set shot = '<think>I add the numbers.</think>The answer is 4.' %}{% endif -%}"
    "{% for m in messages %}{{ m['role'] }}: {% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m['content'] }}\n{% endfor -%}"
    "{{ shot }}\n{{ shot }}\n{{ shot }}\n"
    "{%- if add_generation_prompt %}{% if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{% else %}<think>{% endif %}{% endif %}")
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT, ANSWER = "I add the numbers.", "The answer is 4."
STOP = ["\n"]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(dtype="float32", max_model_len=1024, kv_cache_memory="128MiB", served_model_name="smol",
                          enforce_eager=True)
    with ServerThread(config, reasoning_parser="deepseek_r1", chat_template=TEMPLATE, enable_auto_tool_choice=True,
                      tool_call_parser="hermes", reasoning_budget_message=BUDGET_MESSAGE) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300)


def raw_output(server, messages, **template_kwargs) -> str:
    """What the model writes for the chat, unsplit: the same prompt ids through the completions route."""
    body = {"model": "smol", "messages": messages, "chat_template_kwargs": template_kwargs}
    ids = httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
    r = httpx.post(server.base_url + "/completions", json={"model": "smol", "prompt": ids, "max_tokens": 40,
                                                           "temperature": 0, "stop": STOP}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def chat_streamed(client, **kw):
    """(reasoning, content, tool calls' (name, arguments), finish reason, usage) of a streamed chat."""
    reasoning, reasoning_content, content, calls, finish, usage = "", "", "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            d = c.delta
            extra = d.model_extra or {}
            reasoning += extra.get("reasoning") or ""
            reasoning_content += extra.get("reasoning_content") or ""
            content += d.content or ""
            for call in d.tool_calls or []:
                name, args = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
            finish = c.finish_reason or finish
    assert reasoning == reasoning_content
    return reasoning or None, content or None, list(calls.values()), finish, usage


@pytest.mark.slow
def test_chat_splits_reasoning_from_answer_streamed_and_not(server, client):
    raw = raw_output(server, QUESTION)
    assert raw == f"{THOUGHT}</think>{ANSWER}"          # the model writes the markers (</think>: several tokens)
    r = client.chat.completions.create(model="smol", messages=QUESTION, temperature=0, max_tokens=40, stop=STOP)
    message = r.choices[0].message
    extra = message.model_extra
    assert (extra["reasoning"], extra["reasoning_content"], message.content) == (THOUGHT, THOUGHT, ANSWER)
    assert r.choices[0].finish_reason == "stop"
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.completion_tokens
    streamed = chat_streamed(client, model="smol", messages=QUESTION, temperature=0, max_tokens=40, stop=STOP)
    assert streamed[:4] == (THOUGHT, ANSWER, [], "stop")
    assert streamed[4].completion_tokens_details.reasoning_tokens == details.reasoning_tokens
    assert streamed[4].completion_tokens == r.usage.completion_tokens


@pytest.mark.slow
def test_reasoning_cut_by_max_tokens(client):
    """Cut before </think>: all of it is reasoning, every token counted."""
    r = client.chat.completions.create(model="smol", messages=QUESTION, temperature=0, max_tokens=3, stop=STOP)
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "length"
    assert THOUGHT.startswith(r.choices[0].message.model_extra["reasoning"])
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 3
    assert chat_streamed(client, model="smol", messages=QUESTION, temperature=0, max_tokens=3)[:2] == (
        r.choices[0].message.model_extra["reasoning"], None)


@pytest.mark.slow
def test_enable_thinking_false_reaches_the_template(server, client):
    """The template closes the reasoning in the prompt: the whole output is the answer, reasoning none."""
    raw = raw_output(server, QUESTION, enable_thinking=False)
    kw = dict(model="smol", messages=QUESTION, temperature=0, max_tokens=40, stop=STOP,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == raw and r.choices[0].message.model_extra["reasoning"] is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert chat_streamed(client, **kw)[:2] == (None, raw or None)


@pytest.mark.slow
def test_include_reasoning_false_drops_the_reasoning(server, client):
    kw = dict(model="smol", messages=QUESTION, temperature=0, max_tokens=40, stop=STOP,
              extra_body={"include_reasoning": False})
    message = client.chat.completions.create(**kw).choices[0].message
    assert message.content == ANSWER and message.model_extra["reasoning"] is None
    assert chat_streamed(client, **kw)[:2] == (None, ANSWER)


@pytest.mark.slow
def test_tool_calls_come_from_the_answer(server, client):
    kw = dict(model="smol", messages=[{"role": "user", "content": "Weather in Paris?"}], temperature=0,
              max_tokens=60, stop=STOP, tools=[WEATHER_TOOL])
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == "I call the tool."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert r.choices[0].finish_reason == "tool_calls" and not message.content
    reasoning, content, calls, finish, _ = chat_streamed(client, **kw)
    assert (reasoning, content, finish) == ("I call the tool.", None, "tool_calls")
    assert [(name, json.loads(args)) for name, args in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.slow
def test_responses_reasoning_items_streamed_and_not(client):
    kw = dict(model="smol", input="What is 2 + 2?", temperature=0, max_output_tokens=40,
              extra_body={"stop": STOP})
    r = client.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert [c.text for c in r.output[0].content] == [THOUGHT] and r.output_text == ANSWER
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    deltas, types = [], []
    with client.responses.stream(**kw) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.reasoning_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == THOUGHT and types.index("response.reasoning_text.done") < types.index(
        "response.output_text.delta")
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert [c.text for c in final.output[0].content] == [THOUGHT] and final.output_text == ANSWER
    assert final.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens_details.reasoning_tokens


@pytest.mark.slow
def test_messages_thinking_blocks_streamed_and_not(server, claude):
    kw = dict(model="smol", max_tokens=40, messages=QUESTION, stop_sequences=STOP, extra_body={"temperature": 0})
    m = claude.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", THOUGHT), ("text", ANSWER)]
    assert m.content[0].signature
    with claude.messages.stream(**kw) as stream:
        deltas = [e.delta.thinking for e in stream if e.type == "content_block_delta"
                  and e.delta.type == "thinking_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == THOUGHT
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", THOUGHT), ("text", ANSWER)]
    assert final.content[0].signature and final.usage.output_tokens == m.usage.output_tokens
    # vLLM's chat_template_kwargs on the Messages API: thinking off, one text block
    off = claude.messages.create(**{**kw, "extra_body": {"temperature": 0, "chat_template_kwargs": {
        "enable_thinking": False}}})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == raw_output(
        server, QUESTION, enable_thinking=False)


# ---------------------------------------------------------------------------------------------- the answer's grammar
ANSWERS = [3, 4, 5]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ANSWERS}}, "required": ["answer"],
          "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}}
BUDGET_MESSAGE = " Time is up."      # the server's --reasoning-budget-message


def valid(text) -> bool:
    """The answer is JSON under SCHEMA."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return False
    return isinstance(value, dict) and set(value) == {"answer"} and value["answer"] in ANSWERS


def marker_ids(server) -> list[int]:
    return server.engine.tokenizer.encode("</think>", add_special_tokens=False)


@pytest.mark.slow
def test_the_grammar_starts_after_the_reasoning_streamed_and_not(server, client):
    """The model reasons freely (the few-shot thought, not JSON), writes </think>, and the answer follows the schema;
    without the schema the same prompt's answer is prose."""
    kw = dict(model="smol", messages=QUESTION, temperature=0, max_tokens=60)
    r = client.chat.completions.create(response_format=RESPONSE_FORMAT, **kw)
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == THOUGHT and valid(message.content), message
    assert r.choices[0].finish_reason == "stop"
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens
    streamed = chat_streamed(client, response_format=RESPONSE_FORMAT, **kw)
    assert streamed[:2] == (THOUGHT, message.content) and streamed[3] == "stop"
    assert not valid(client.chat.completions.create(stop=STOP, **kw).choices[0].message.content)
    # vLLM's structured_outputs field, the same grammar
    r = client.chat.completions.create(extra_body={"structured_outputs": {"json": SCHEMA}}, **kw)
    assert r.choices[0].message.model_extra["reasoning"] == THOUGHT and valid(r.choices[0].message.content)


@pytest.mark.slow
def test_a_prompt_that_closed_the_reasoning_is_constrained_from_its_first_token(server, client):
    kw = dict(model="smol", messages=QUESTION, temperature=0, max_tokens=40, response_format=RESPONSE_FORMAT,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True})
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert message.model_extra["reasoning"] is None and valid(message.content), message
    first = server.engine.tokenizer.decode(r.choices[0].model_extra["token_ids"][:1])
    assert first and "{".startswith(first[0]) or first.startswith("{"), first
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert chat_streamed(client, **kw)[:2] == (None, message.content)


def sampled_choices(client, requests: int, n: int, **kw) -> list:
    """`requests` chat requests of n choices each, at once (one continuous batch)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i):
        return client.chat.completions.create(model="smol", messages=QUESTION, n=n, seed=1000 * i, **kw).choices

    with ThreadPoolExecutor(requests) as pool:
        return [c for choices in pool.map(one, range(requests)) for c in choices]


@pytest.mark.slow
def test_sampled_reasoning_is_free_and_every_answer_is_valid(server, client):
    """50 choices at temperature 1, batched: the reasoning is whatever the model samples (text, not JSON), ended by
    the model or by its budget, and every answer is valid JSON under the schema."""
    budget = 6
    choices = sampled_choices(client, 5, 10, temperature=1.0, max_tokens=60, response_format=RESPONSE_FORMAT,
                              extra_body={"thinking_token_budget": budget, "return_token_ids": True})
    assert len(choices) == 50
    for c in choices:
        assert valid(c.message.content), (c.message.model_extra["reasoning"], c.message.content)
        assert c.finish_reason == "stop"
    thoughts = [c.message.model_extra["reasoning"] or "" for c in choices]
    assert len(set(thoughts)) >= 5 and all(any(ch.isalpha() for ch in t) for t in thoughts), thoughts
    forced = [t for t in thoughts if t.endswith(BUDGET_MESSAGE)]
    assert forced, thoughts       # the budget ended some: at most `budget` of the model's tokens before the message
    tok = server.engine.tokenizer
    assert all(len(tok.encode(t[:-len(BUDGET_MESSAGE)], add_special_tokens=False)) <= budget + 1 for t in forced)
    # streamed: the same holds for every choice
    for chunk_choices in [chat_streamed(client, model="smol", messages=QUESTION, temperature=1.0, max_tokens=60,
                                        seed=s, response_format=RESPONSE_FORMAT,
                                        extra_body={"thinking_token_budget": budget}) for s in range(3)]:
        assert valid(chunk_choices[1]), chunk_choices


@pytest.mark.slow
def test_responses_text_format_constrains_the_answer(client):
    kw = dict(model="smol", input="What is 2 + 2?", temperature=0, max_output_tokens=60,
              text={"format": {"type": "json_schema", "name": "sum", "schema": SCHEMA}})
    r = client.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert [c.text for c in r.output[0].content] == [THOUGHT] and valid(r.output_text), r.output_text
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert [c.text for c in final.output[0].content] == [THOUGHT] and final.output_text == r.output_text


@pytest.mark.slow
def test_forced_tool_calls_follow_the_reasoning(client, claude):
    """tool_choice required (chat) and any / tool (Messages): the reasoning, then a call the grammar holds to the
    tool's schema. The budget ends the reasoning the model writes (its `</think><tool_call>` merges into other
    tokens than `</think>` alone: the engine sees no end there)."""
    kw = dict(model="smol", messages=[{"role": "user", "content": "Weather in Paris?"}], temperature=0, max_tokens=80,
              tools=[WEATHER_TOOL], tool_choice="required", extra_body={"thinking_token_budget": 5})
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert message.model_extra["reasoning"].startswith("I call the tool")
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert len(calls) >= 1 and all(name == "get_weather" and isinstance(args["city"], str) for name, args in calls)
    reasoning, _, streamed_calls, finish, _ = chat_streamed(client, **kw)
    assert reasoning == message.model_extra["reasoning"] and finish == "tool_calls"
    assert [(name, json.loads(args)) for name, args in streamed_calls] == calls
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        mkw = dict(model="smol", max_tokens=80, messages=[{"role": "user", "content": "Weather in Paris?"}],
                   tools=[tool], tool_choice=choice, thinking={"type": "enabled", "budget_tokens": 5},
                   extra_body={"temperature": 0})
        m = claude.messages.create(**mkw)
        assert [b.type for b in m.content][0] == "thinking" and m.stop_reason == "tool_use"
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
        with claude.messages.stream(**mkw) as stream:
            final = stream.get_final_message()
        assert [(b.type, getattr(b, "input", None)) for b in final.content][1:] == [
            (b.type, getattr(b, "input", None)) for b in m.content][1:]


@pytest.mark.slow
def test_messages_output_format_constrains_the_answer(claude):
    kw = dict(model="smol", max_tokens=60, messages=QUESTION, extra_body={
        "temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    m = claude.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == THOUGHT
    assert valid(m.content[1].text), m.content
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == m.content[1].text


# ---------------------------------------------------------------------------------------------- thinking budgets
@pytest.mark.slow
def test_a_thinking_budget_forces_the_end_of_the_reasoning(server, client):
    """At most `budget` tokens of the model's reasoning, then the budget message and </think> (forced), then an
    answer; a budget the model stays under changes nothing."""
    tok = server.engine.tokenizer
    forced = tok.encode(BUDGET_MESSAGE, add_special_tokens=False) + marker_ids(server)
    kw = dict(model="smol", messages=QUESTION, temperature=0, max_tokens=40, stop=STOP)
    free = client.chat.completions.create(extra_body={"return_token_ids": True}, **kw).choices[0]
    for budget in (0, 2):
        r = client.chat.completions.create(extra_body={"thinking_token_budget": budget, "return_token_ids": True},
                                           **kw)
        ids = r.choices[0].model_extra["token_ids"]
        assert ids[:budget] == free.model_extra["token_ids"][:budget]        # the model's own, up to the budget
        assert ids[budget:budget + len(forced)] == forced
        message = r.choices[0].message
        assert message.model_extra["reasoning"] == tok.decode(ids[:budget]) + BUDGET_MESSAGE
        assert message.content and r.usage.completion_tokens_details.reasoning_tokens == budget + len(forced)
        streamed = chat_streamed(client, extra_body={"thinking_token_budget": budget}, **kw)
        assert streamed[:2] == (message.model_extra["reasoning"], message.content)
    r = client.chat.completions.create(extra_body={"thinking_token_budget": 30}, **kw)
    assert r.choices[0].message.model_extra["reasoning"] == THOUGHT and r.choices[0].message.content == ANSWER


@pytest.mark.slow
def test_a_forced_end_is_followed_by_a_valid_answer(client):
    r = client.chat.completions.create(model="smol", messages=QUESTION, temperature=0, max_tokens=60,
                                       response_format=RESPONSE_FORMAT, extra_body={"thinking_token_budget": 1})
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == "I" + BUDGET_MESSAGE and valid(message.content), message


@pytest.mark.slow
def test_messages_thinking_budget_tokens(claude):
    kw = dict(model="smol", max_tokens=40, messages=QUESTION, stop_sequences=STOP, extra_body={"temperature": 0})
    m = claude.messages.create(thinking={"type": "enabled", "budget_tokens": 2}, **kw)
    assert m.content[0].type == "thinking" and m.content[0].thinking == "I add" + BUDGET_MESSAGE
    assert claude.messages.create(thinking={"type": "disabled"}, **kw).content[0].thinking == THOUGHT
    for thinking, param in (({"type": "adaptive"}, "thinking.type"),
                            ({"type": "enabled", "budget_tokens": -1}, "thinking.budget_tokens"),
                            ({"type": "enabled", "budget_tokens": 5, "x": 1}, "thinking.x")):
        with pytest.raises(anthropic.BadRequestError, match=param.replace(".", r"\.")):
            claude.messages.create(thinking=thinking, **kw)


def test_a_thinking_budget_needs_a_reasoning_parser():
    serving = OpenAIServing(FakeEngine())
    req = ChatCompletionRequest(model="fake", messages=QUESTION, thinking_token_budget=4)
    with pytest.raises(APIError) as e:
        asyncio.run(serving.preparer.prepare_chat(req))
    assert e.value.param == "thinking_token_budget"


def prompt_text(server, messages) -> str:
    r = httpx.post(server.url + "/tokenize", json={"model": "smol", "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    return httpx.post(server.url + "/detokenize", json={"model": "smol", "tokens": ids}, timeout=60).json()["prompt"]


@pytest.mark.slow
def test_earlier_reasoning_passed_back_reaches_the_template(server, client, claude):
    """A conversation that carries the reasoning of an earlier reply (chat's `reasoning`, a Responses reasoning
    item, a Messages thinking block) renders the same prompt on every surface, the reasoning in it."""
    chat = [*QUESTION, {"role": "assistant", "content": ANSWER, "reasoning": THOUGHT},
            {"role": "user", "content": "And 3 + 3?"}]
    text = prompt_text(server, chat)
    assert f"assistant: <think>{THOUGHT}</think>{ANSWER}\n" in text
    assert prompt_text(server, [{**m, "reasoning_content": m.pop("reasoning")} if "reasoning" in m else m
                                for m in json.loads(json.dumps(chat))]) == text
    ids = httpx.post(server.url + "/tokenize", json={"model": "smol", "messages": chat}, timeout=60).json()["count"]
    r = client.responses.create(model="smol", max_output_tokens=1, input=[
        {"role": "user", "content": QUESTION[0]["content"]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ANSWER}]},
        {"role": "user", "content": "And 3 + 3?"}])
    assert r.usage.input_tokens == ids
    m = claude.messages.create(model="smol", max_tokens=1, messages=[
        *QUESTION, {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": "s"},
                                                     {"type": "text", "text": ANSWER}]},
        {"role": "user", "content": "And 3 + 3?"}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ids
    r = httpx.post(server.base_url + "/chat/completions", json={"model": "smol", "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi", "reasoning": "x"}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
