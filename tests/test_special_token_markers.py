"""Tool-call markers that are special tokens, and the token that ends a request, over HTTP with the openai client.

In Mistral's and Gemma 4's tokenizers [TOOL_CALLS] and <|tool_call>, <tool_call|>, <|"|> are special tokens, which
skip_special_tokens (on by default) drops from the text before a parser could read them; a request with tools under
--tool-call-parser mistral / gemma4 is detokenized with them (as vLLM's adjust_request). The tiny model's tokenizer
holds the markers as real special tokens, and the model's output is forced with a structured-outputs grammar that
names the marker's token id (`<[id]>`), so the marker is that one token, as a real model writes it. Then
skip_special_tokens=false shows the EOS or stop token that ended a request nowhere in its text (as vLLM), chat and
completions, whole and streamed, unless include_stop_str_in_output.
"""
from __future__ import annotations

import json
import re

import pytest

from tool_parser_checks import TOOLS, client_of, streamed, tool_server
from tiny_models import SMOLLM2_VOCAB

MISTRAL_MARKERS = ("[TOOL_CALLS]", "[ARGS]")
GEMMA4_MARKERS = ("<|tool_call>", "<tool_call|>", '<|"|>')
EOS_TEXT = "<|im_end|>"       # the SmolLM2 tokenizer's EOS


def grammar(text: str, markers: tuple[str, ...]) -> str:
    """A Lark grammar whose one sentence is `text`, each marker in it as its special token (ids from SMOLLM2_VOCAB
    on, in `markers`' order) and the rest as text."""
    split = re.split("(" + "|".join(map(re.escape, markers)) + ")", text)
    parts = [f"<[{SMOLLM2_VOCAB + markers.index(p)}]>" if p in markers else json.dumps(p) for p in split if p]
    return "start: " + " ".join(parts)


def chat(client, output: str, markers, stream=False, **kw):
    """A chat whose output is forced to be `output`, markers as special tokens."""
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
        max_tokens=200, stream=stream, extra_body={"structured_outputs": {"grammar": grammar(output, markers)},
                                                   **kw.pop("extra_body", {})}, **kw)


def check_reads_calls(client, output: str, markers, content: str | None, calls: list[tuple[str, dict]]) -> None:
    """Under tool_choice "auto" the forced output is read into (content, calls), whole and streamed, even when the
    request asks for skip_special_tokens=true (as vLLM, the parser's need holds over it). Without tools, or under
    tool_choice "none", the markers are special tokens, skipped: the check can fail."""
    for extra in ({}, {"skip_special_tokens": True}):
        r = chat(client, output, markers, tools=TOOLS, extra_body=extra)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (extra, choice)
        assert choice.message.content == content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == calls
        got_content, got_calls, finish = streamed(chat(client, output, markers, stream=True, tools=TOOLS,
                                                       extra_body=extra))
        assert finish == "tool_calls"
        assert (got_content or "").strip() == (content or "").strip()
        assert [(name, json.loads(args)) for _, name, args in got_calls] == calls
    plain = chat(client, output, markers).choices[0].message.content
    assert chat(client, output, markers, tools=TOOLS, tool_choice="none").choices[0].message.content == plain
    assert not any(m in plain for m in markers) and plain == re.sub("|".join(map(re.escape, markers)), "", output)
    kept = chat(client, output, markers, extra_body={"skip_special_tokens": False}).choices[0].message.content
    assert kept == output          # with tools or without, the grammar wrote the markers as their tokens


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    with tool_server(tmp_path_factory.mktemp("tiny-mistral-special"), "mistral", "mistral_format.jinja",
                     MISTRAL_MARKERS) as s:
        yield s


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    with tool_server(tmp_path_factory.mktemp("tiny-gemma4-special"), "gemma4", "gemma4_format.jinja",
                     GEMMA4_MARKERS) as s:
        yield s


@pytest.mark.slow
def test_mistral_reads_its_special_token_marker(mistral):
    client = client_of(mistral)
    check_reads_calls(client, 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                      MISTRAL_MARKERS, "Checking.", [("get_weather", {"city": "Paris"})])
    check_reads_calls(client, '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}', MISTRAL_MARKERS, None,
                      [("add", {"a": 2, "b": 3})])


@pytest.mark.slow
def test_gemma4_reads_its_special_token_markers(gemma4):
    check_reads_calls(client_of(gemma4), 'Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}'
                                         '<tool_call|>', GEMMA4_MARKERS, "Checking.",
                      [("get_weather", {"city": "Paris", "days": 3})])


# ---------------------------------------------------------------------------------------------- the ending token
END_SOON = {"min_tokens": 3, "logit_bias": {"2": 100}}     # three tokens, then EOS (id 2), greedily


@pytest.mark.slow
def test_the_eos_that_ended_a_request_is_not_in_its_text(mistral):
    """skip_special_tokens=false: other special tokens would show, the EOS that stopped the request does not (vLLM);
    include_stop_str_in_output=true keeps it."""
    client = client_of(mistral)
    message = [{"role": "user", "content": "Hi"}]
    for include in (False, True):
        extra = {**END_SOON, "skip_special_tokens": False, "include_stop_str_in_output": include}
        r = client.chat.completions.create(model="tiny", messages=message, max_tokens=10, temperature=0,
                                           extra_body=extra)
        chat_text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4
        chunks = client.chat.completions.create(model="tiny", messages=message, max_tokens=10, temperature=0,
                                                stream=True, extra_body=extra)
        assert streamed(chunks)[0] == chat_text
        c = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0, extra_body=extra)
        text = c.choices[0].text
        assert c.choices[0].finish_reason == "stop" and c.usage.completion_tokens == 4
        chunks = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0, stream=True,
                                           extra_body=extra)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
        for got in (chat_text, text):
            assert got.endswith(EOS_TEXT) if include else EOS_TEXT not in got and got


@pytest.mark.slow
def test_a_stop_token_id_that_ended_a_request_is_not_in_its_text(mistral):
    """The same for a stop token id: here the special token <|im_start|> (id 1)."""
    client = client_of(mistral)
    extra = {"min_tokens": 2, "logit_bias": {"1": 100}, "stop_token_ids": [1], "skip_special_tokens": False}
    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0, extra_body=extra)
    assert c.choices[0].finish_reason == "stop" and c.usage.completion_tokens == 3
    assert "<|im_start|>" not in c.choices[0].text and c.choices[0].text
    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0,
                                  extra_body={**extra, "include_stop_str_in_output": True})
    assert c.choices[0].text.endswith("<|im_start|>")
