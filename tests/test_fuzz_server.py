"""A fuzzer aimed at the engine, not only at the schema: hypothesis builds requests whose every field may be
valid, extreme (ints past int64, NaN, Infinity, 1e-300), of the wrong type, full of lone surrogates, or a huge
list, and sends them to a real server on a tiny model. Whatever comes in: no 5xx, the engine stays alive, the
server answers afterwards, and once idle no KV block is held. Bounded (examples and per-request time) to
fit CI."""
from __future__ import annotations

import collections
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

MAX_MODEL_LEN = 128
STATUS: collections.Counter = collections.Counter()    # answers the fuzzer got: it must reach the engine too


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-fuzz"), family="llama", seed=3)
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="8MiB",
                          served_model_name="tiny", max_num_seqs=8)
    with ServerThread(config, max_queue_len=16) as s:
        yield s


BIG_INTS = st.sampled_from([-(2**63) - 1, -(2**63), -1, 0, 1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, 2**70])
ODD_FLOATS = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e-300, -1e-300, 1e300, -0.0, 0.5, 2.0])
HOSTILE_TEXT = st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "\u202e", "\U0001F600" * 50, "x" * 20_000])
TEXT = st.one_of(st.text(max_size=40), HOSTILE_TEXT)
WRONG_TYPES = st.sampled_from([None, True, [], {}, "7", [1, "a"], {"a": None}])
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 49151), BIG_INTS), max_size=8)


HOSTILE = st.one_of(BIG_INTS, ODD_FLOATS, WRONG_TYPES, HOSTILE_TEXT,
                    st.lists(st.just("z"), min_size=100, max_size=100),
                    st.lists(st.just(5), min_size=2000, max_size=2000),
                    st.dictionaries(st.one_of(st.integers(-5, 60000).map(str), TEXT), ODD_FLOATS, max_size=3))

# plausible values; a request then gets up to three fields replaced by hostile ones (or none, so that many
# requests reach the engine and run)
SAMPLING_FIELDS = {
    "max_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 100),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "seed": st.integers(-5, 5),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
    "logprobs": st.integers(0, 5),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "best_of": st.integers(1, 3),
    "model": st.sampled_from(["tiny", "tiny", "x", ""]),
}
CHAT_FIELDS = {"top_logprobs": st.integers(0, 5), "max_completion_tokens": st.integers(1, 8)}
PROMPT = st.one_of(st.text(max_size=40), st.lists(st.text(max_size=20), min_size=1, max_size=3),
                   st.lists(st.integers(0, 49151), min_size=1, max_size=8))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                           "content": st.one_of(st.text(max_size=40),
                                                                st.just([{"type": "text", "text": "hi"}]))}),
                    min_size=1, max_size=3)


def request_body(route: str) -> st.SearchStrategy:
    fields = dict(SAMPLING_FIELDS, **(CHAT_FIELDS if route == "/v1/chat/completions" else {}))
    fields["prompt" if route == "/v1/completions" else "messages"] = \
        PROMPT if route == "/v1/completions" else MESSAGES
    required = "prompt" if route == "/v1/completions" else "messages"
    plausible = st.fixed_dictionaries({required: fields.pop(required)}, optional=fields)
    hostile = st.dictionaries(st.sampled_from(sorted(fields) + [required]), HOSTILE, max_size=3)
    return st.tuples(plausible, st.one_of(st.just({}), hostile)).map(lambda d: {**d[0], **d[1]})


ROUTES = ["/v1/completions", "/v1/chat/completions"]


def send_one(server, data) -> None:
    route = data.draw(st.sampled_from(ROUTES + ["/tokenize", "/detokenize"]))
    if route == "/tokenize":
        body = data.draw(st.fixed_dictionaries({}, optional={"prompt": st.one_of(TEXT, HOSTILE),
                                                             "messages": st.one_of(MESSAGES, HOSTILE)}))
    elif route == "/detokenize":
        body = data.draw(st.fixed_dictionaries({"tokens": st.one_of(TOKEN_IDS, HOSTILE)}))
    else:
        body = data.draw(request_body(route))
    raw = json.dumps(body, allow_nan=True).encode()     # NaN / Infinity as Python writes them; \ud800 escaped
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", route, content=raw, headers={"content-type": "application/json"}) as r:
            payload = r.read()
            STATUS[r.status_code, route] += 1
            assert r.status_code < 500, (body, payload[:500])
            if r.status_code >= 400:
                err = json.loads(payload)["error"]
                assert set(err) == {"message", "type", "param", "code"}, err
            elif body.get("stream") is True and route in ROUTES:
                assert payload.rstrip().endswith(b"data: [DONE]"), payload[-300:]
    assert server.engine.is_alive, server.engine.death_reason


@pytest.mark.slow
@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_no_request_can_hurt_the_server(server, data):
    send_one(server, data)


@pytest.mark.slow
def test_after_the_fuzzer_the_server_serves_and_holds_nothing(server):
    """Runs after the fuzzer (file order) on the same server."""
    generated = sum(n for (status, route), n in STATUS.items() if status == 200 and route.startswith("/v1/"))
    assert not STATUS or generated >= 10, f"the fuzzer hardly reached the engine: {STATUS}"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "still here", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    server.wait_idle()
    assert server.engine.last_stats.kv_cache_usage == 0
    server.core("check")


# ---- the same with tensor parallelism: the faults must stay on rank 0's side of the step -------------------------
@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-fuzz-tp"), family="llama", seed=4)
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="8MiB",
                          served_model_name="tiny", max_num_seqs=8, tensor_parallel_size=2, device="cpu")
    with ServerThread(config, max_queue_len=16) as s:
        yield s


ISSUE_14_ROWS = [{"stop_token_ids": [1000000], "min_tokens": 2}, {"stop_token_ids": [2**70], "min_tokens": 2},
                 {"top_k": 10**20, "temperature": 0.8}, {"seed": 10**30, "n": 2},
                 {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": 1e-300},
                 {"repetition_penalty": float("nan")}]


@pytest.mark.slow
@pytest.mark.parametrize("row", ISSUE_14_ROWS, ids=lambda r: ",".join(r))
def test_once_fatal_rows_are_400_with_tensor_parallelism(tp_server, row):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **row}
    r = httpx.post(tp_server.url + "/v1/chat/completions", content=json.dumps(body, allow_nan=True).encode(),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in row
    assert tp_server.engine.is_alive


@pytest.mark.slow
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_no_request_can_hurt_a_tensor_parallel_server(tp_server, data):
    send_one(tp_server, data)


@pytest.mark.slow
def test_after_the_tp_fuzzer_the_server_serves_and_holds_nothing(tp_server):
    r = httpx.post(tp_server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    tp_server.wait_idle()
    assert tp_server.engine.last_stats.kv_cache_usage == 0
    tp_server.core("check")
