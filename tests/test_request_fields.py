"""The field rule: every field of vLLM's chat and completions request schemas is implemented (a field
of kvflow's pydantic model) or refused with a 400 naming it when set; never accepted and dropped. Through the real
server with httpx (the official client has no names for most of these; `extra_body` sends the same JSON)."""
from __future__ import annotations

import logging

import httpx
import pytest

from kvflow.config import EngineConfig
from kvflow.server.serving.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.server.serving.request_fields import (BEAM_SEARCH_READS, BEAM_SEARCH_REFUSED, OPENAI_ONLY, REFUSED,
                                                  VLLM_FIELDS, VLLM_FORMER_FIELDS)
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BASE = {"chat": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "completions": {"model": "tiny", "prompt": "hi", "max_tokens": 2}}


def a_value_other_than(default):
    """A value that asks for the field's feature."""
    if default is True:
        return False
    if default is False:
        return True
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return default + 1
    return [1, 2]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_every_vllm_field_is_implemented_or_refused(route):
    implemented = set(MODELS[route].model_fields)
    refused = set(REFUSED[route])
    assert not implemented & refused, implemented & refused
    missing = [f for f in VLLM_FIELDS[route] if f not in implemented | refused]
    assert not missing, f"{route}: neither implemented nor refused: {missing}"
    assert set(OPENAI_ONLY) <= refused
    assert set(VLLM_FORMER_FIELDS[route]) <= refused      # early_stopping: vLLM dropped it, kvflow says so


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_beside_use_beam_search_every_field_is_read_or_refused(route):
    """Beam search reads fewer fields than sampling: each field kvflow implements is, with use_beam_search, either
    read by the beam search path or a 400 naming it (BEAM_SEARCH_REFUSED), never accepted and dropped."""
    implemented = set(MODELS[route].model_fields)
    reads, refused = set(BEAM_SEARCH_READS[route]), set(BEAM_SEARCH_REFUSED[route])
    assert not reads & refused, reads & refused
    assert reads | refused == implemented, (implemented - reads - refused, (reads | refused) - implemented)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-fields"), family="llama", seed=2)
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory="8MiB",
                          served_model_name="tiny", enforce_eager=True)
    with ServerThread(config) as s:
        yield s


@pytest.mark.slow
@pytest.mark.parametrize("route, field", [(r, f) for r in ("chat", "completions") for f in sorted(REFUSED[r])])
def test_a_refused_field_set_is_a_400_naming_it(server, route, field):
    body = {**BASE[route], field: a_value_other_than(REFUSED[route][field])}
    r = httpx.post(server.url + ROUTES[route], json=body, timeout=30)
    assert r.status_code == 400, (field, r.text)
    err = r.json()["error"]
    assert err["param"] == field and "not supported" in err["message"]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_refused_fields_at_their_defaults_and_unknown_fields_are_accepted(server, route, caplog):
    unknown = f"a_field_nobody_defines_{route}"
    body = {**BASE[route], **{f: d for f, d in REFUSED[route].items()}, unknown: 1}
    with caplog.at_level(logging.WARNING, logger="kvflow.server"):
        for _ in range(2):
            r = httpx.post(server.url + ROUTES[route], json=body, timeout=30)
            assert r.status_code == 200, r.text
    logged = [rec for rec in caplog.records if unknown in rec.getMessage()]
    assert len(logged) == 1, logged          # ignored, as vLLM does, and logged once per name


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_stream_options_without_stream_is_a_400(server, route):
    body = {**BASE[route], "stream_options": {"include_usage": True}}
    r = httpx.post(server.url + ROUTES[route], json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    r = httpx.post(server.url + ROUTES[route], json={**body, "stream": True}, timeout=30)
    assert r.status_code == 200, r.text


def a_value_beam_search_refuses(route: str, field: str):
    """A value of `field` that asks for what beam search does not do."""
    special = {"stream": True, "stop": ["x"], "response_format": {"type": "json_object"}, "guided_json": {},
               "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": 'start: "a"',
               "structured_outputs": {"regex": "a+"}, "logit_bias": {"5": 1.0}, "allowed_token_ids": [5, 6],
               "bad_words": ["bad"], "stop_token_ids": [5], "logprobs": True if route == "chat" else 2,
               "top_logprobs": 2, "stream_options": {"include_usage": True}, "seed": 1, "top_p": 0.5, "top_k": 5,
               "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
               "min_tokens": 1, "prompt_logprobs": 1, "guided_json_object": True, "return_tokens_as_token_ids": True,
               "thinking_token_budget": 8, "return_progress": True}
    return special[field]


@pytest.mark.slow
@pytest.mark.parametrize("route, field", [(r, f) for r in ("chat", "completions") for f in BEAM_SEARCH_REFUSED[r]])
def test_a_field_beam_search_does_not_read_is_a_400_naming_it_beside_use_beam_search(server, route, field):
    body = {**BASE[route], "use_beam_search": True, "n": 2, field: a_value_beam_search_refuses(route, field)}
    if field == "top_logprobs":
        body["logprobs"] = True if route == "chat" else None
    if field in ("stream_options", "return_progress"):      # each needs stream
        body["stream"] = True
    r = httpx.post(server.url + ROUTES[route], json=body, timeout=30)
    assert r.status_code == 400, (field, r.text)
    # top_logprobs needs logprobs, which beam search refuses first; stream_options needs stream, refused first
    expected = {"top_logprobs": "logprobs", "stream_options": "stream"}.get(field, field)
    assert r.json()["error"]["param"] == expected, r.text
    # the same value without use_beam_search is a sampling request like any (the field is implemented; a thinking
    # budget needs --reasoning-parser, which this server lacks: test_reasoning.py runs it)
    body.pop("use_beam_search")
    if field not in ("stream", "stream_options", "thinking_token_budget"):
        r = httpx.post(server.url + ROUTES[route], json=body, timeout=30)
        assert r.status_code == 200, (field, r.text)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_beam_search_fields_at_their_neutral_values_are_accepted(server, route):
    """What asks for nothing (unset, top_p 1, stop [], logprobs false, ...) is no refusal beside use_beam_search."""
    # (top_logprobs needs logprobs true, stream_options stream true, whatever beam search says)
    neutral = {f: values[0] for f, values in BEAM_SEARCH_REFUSED[route].items()
               if values and f not in ("top_logprobs", "stream_options")}
    body = {**BASE[route], "use_beam_search": True, "n": 2, "temperature": 0, **neutral}
    r = httpx.post(server.url + ROUTES[route], json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
