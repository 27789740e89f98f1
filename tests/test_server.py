"""The real server (uvicorn + AsyncEngine, tiny random-weight model) through the official openai client."""
from __future__ import annotations

import asyncio
import inspect
import json
import random
import time

import httpx
import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.server.serving.engine_client import EngineClient
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-server"), family="llama", seed=0)


def engine_config(model_path, **kw) -> EngineConfig:
    args = dict(model=str(model_path), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="32MiB",
                max_num_seqs=64, max_num_batched_tokens=512, served_model_name="tiny")
    args.update(kw)
    return EngineConfig(**args)


@pytest.fixture(scope="module")
def server(model_path):
    with ServerThread(engine_config(model_path)) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def chat(client, content="Hello, who are you?", **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


def assert_idle_and_empty(server):
    server.wait_idle()
    assert server.engine.last_stats.kv_cache_usage == 0
    server.core("check")


# ---- happy paths ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_models_health_version(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


def test_the_engine_is_an_engine_client(server):
    """AsyncEngine has every attribute the serving seam reads and takes every argument the seam passes."""
    assert isinstance(server.engine, EngineClient)
    for name in ("submit", "beam_search", "shutdown", "add_lora", "remove_lora"):
        wanted = inspect.signature(getattr(EngineClient, name)).parameters
        given = inspect.signature(getattr(type(server.engine), name)).parameters
        assert set(wanted) <= set(given), name
    assert inspect.iscoroutinefunction(type(server.engine).shutdown)


def test_chat_non_streamed_schema_and_usage(client, http):
    r = chat(client, max_tokens=7, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert isinstance(r.created, int)
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    n_prompt = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello, who are you?"}]}
                         ).json()["count"]
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == n_prompt + 7
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_content_parts_and_system(client):
    a = client.chat.completions.create(
        model="tiny", max_tokens=5, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                  {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "Again"}])
    assert a.choices[0].message.content is not None


def test_chat_streamed_equals_non_streamed(client):
    full = chat(client, max_tokens=16, extra_body={"ignore_eos": True})
    chunks = list(chat(client, max_tokens=16, stream=True, stream_options={"include_usage": True},
                       extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == full.choices[0].message.content
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format(http):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_completions_streamed_and_not(client):
    r = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    chunks = list(client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_completions_prompt_forms(client, http):
    ids = http.post("/tokenize", json={"prompt": "one two three"}).json()["tokens"]
    a = client.completions.create(model="tiny", prompt="one two three", max_tokens=6, temperature=0)
    b = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert b.usage.prompt_tokens == len(ids)
    many = client.completions.create(model="tiny", prompt=["one two three", "four five"], max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == a.choices[0].text
    assert many.usage.completion_tokens == 12
    both_ids = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=6, temperature=0)
    assert both_ids.choices[0].text == both_ids.choices[1].text == a.choices[0].text


def test_tokenize_detokenize_roundtrip(http):
    ids = http.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "hello world"


def test_n2_and_seed_reproducibility(client):
    kw = dict(max_tokens=10, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    r1 = chat(client, n=2, **kw)
    r2 = chat(client, n=2, **kw)
    assert [c.index for c in r1.choices] == [0, 1]
    assert [c.message.content for c in r1.choices] == [c.message.content for c in r2.choices]
    assert r1.choices[0].message.content != r1.choices[1].message.content  # child seeds differ (seed + i)
    assert r1.usage.completion_tokens == 20
    r3 = chat(client, max_tokens=10, temperature=1.0, seed=999, extra_body={"ignore_eos": True})
    assert r3.choices[0].message.content != r1.choices[0].message.content
    # n=2 streamed: both indexes arrive and finish
    finished = set()
    for c in chat(client, n=2, stream=True, **kw):
        for ch in c.choices:
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}


def test_a_chat_streams_finish_chunk_has_string_content_as_vllms(server, client):
    """vLLM's test_chat_completion_stream_options (include_usage false) concatenates every chunk's delta.content:
    the chunk that carries finish_reason after the EOS (a special token: no text of its own) has content "", not
    null. logit_bias makes the EOS the reply's first token."""
    eos = server.engine.tokenizer.eos_token_id
    chunks = list(chat(client, max_tokens=8, stream=True, stream_options={"include_usage": False},
                       logit_bias={str(eos): 100}))
    finish = [c for c in chunks if c.choices[0].finish_reason is not None]
    assert len(finish) == 1 and chunks[-1] is finish[0] and finish[0].choices[0].finish_reason == "stop"
    assert finish[0].choices[0].delta.content == ""
    text = ""
    for c in chunks:
        assert c.usage is None
        text += c.choices[0].delta.content      # a str on every chunk, the finish included
    assert text == ""


def test_without_enable_per_request_metrics_no_response_has_metrics(http):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and "metrics" not in r.json()
    r = http.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and '"usage"' in r.text and '"metrics"' not in r.text


def test_stop_strings(client):
    base = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert len(text) > 12
    stop = text[5:9]
    expected = text[:text.find(stop)]
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 20
    streamed = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20,
                                              temperature=0, stop=stop, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    kept = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop


@pytest.mark.slow
def test_a_stream_read_after_its_request_finished_gets_every_delta(model_path):
    """A consumer slower than the engine: every step's deltas wait in the stream's queue. The stream once stopped
    after the first of them, because it asked the request's state (already finished) rather than the step."""
    from kvflow import SamplingParams
    from kvflow.async_engine import AddRequest, AsyncEngine

    async def run():
        engine = AsyncEngine.from_config(engine_config(model_path)).start()
        try:
            stream = engine.submit(AddRequest("slow", [1, 2, 3],
                                              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
            while not stream.finished:
                await asyncio.sleep(0.01)
            return [d async for d in stream]
        finally:
            engine.stop()

    deltas = asyncio.run(run())
    assert sum(len(d.token_ids) for d in deltas) == 8
    assert deltas[-1].finish_reason == "length"


def test_logprobs(client):
    r = chat(client, max_tokens=6, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3
        assert e.logprob <= 0
        assert e.top_logprobs[0].token == e.token  # greedy: the sampled token is the most likely
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.bytes == list(e.token.encode())
    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == c.choices[0].text
    plain = chat(client, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_32_concurrent_streams_match_offline_llm(server, model_path):
    from kvflow import LLM, SamplingParams

    prompts = [f"Q{i}: tell me something about the number {i}" for i in range(32)]
    max_tokens = 16

    async def one(aclient, prompt):
        text, finish = "", None
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))
        finally:
            await aclient.close()

    steps_before = server.engine.num_steps
    results = asyncio.run(run_all())
    assert all(f == "length" for _, f in results)
    assert server.engine.max_batch_size > 1, "the engine never ran two requests in one step"
    assert server.engine.num_steps - steps_before < 32 * max_tokens  # batched, not one request per step
    llm = LLM(str(model_path), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="32MiB")
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert [t for t, _ in results] == [o.outputs[0].text for o in offline]
    assert_idle_and_empty(server)


# ---- bad input --------------------------------------------------------------------------------------------------
def assert_openai_error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param != "any":
        assert err["param"] == param
    return err


def test_prompt_too_long_is_400_with_both_numbers(http, client):
    prompt = "hello " * 600
    err = assert_openai_error(http.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                                 "max_tokens": 10}), 400)
    assert str(MAX_MODEL_LEN) in err["message"]
    n_prompt = http.post("/tokenize", json={"prompt": "hello " * 200}).json()["count"]
    err = assert_openai_error(http.post("/v1/completions", json={"model": "tiny", "prompt": "hello " * 200,
                                                                 "max_tokens": 400}), 400)
    assert str(MAX_MODEL_LEN) in err["message"] and str(n_prompt + 400) in err["message"]
    with pytest.raises(openai.BadRequestError):
        chat(client, content="hi " * 600)


def test_unknown_model_404(http, client):
    err = assert_openai_error(http.post("/v1/chat/completions", json={
        "model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404, param="model")
    assert "gpt-9" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_malformed_json_and_wrong_types_400(http):
    assert_openai_error(http.post("/v1/chat/completions", content=b"{not json",
                                  headers={"content-type": "application/json"}), 400)
    assert_openai_error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": "hello"}), 400,
                        param="messages")
    assert_openai_error(http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}), 400,
        param="max_tokens")
    assert_openai_error(http.post("/v1/completions", json={"model": "tiny"}), 400, param="prompt")
    assert_openai_error(http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": 7, "content": "x"}]}), 400, param="messages.0.role")
    # any role string reaches the chat template, as vLLM passes it (the template may refuse it: a 400 then)
    assert http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "wizard", "content": "x"}], "max_tokens": 2}).status_code == 200
    assert_openai_error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": []}), 400)


def test_invalid_sampling_values_400_with_param(http):
    for field, value in (("temperature", -1), ("top_p", 0), ("n", 0), ("max_tokens", 0),
                         ("presence_penalty", 5), ("top_k", -5)):
        err = assert_openai_error(http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], field: value}), 400)
        assert err["param"] == field, err
    assert_openai_error(http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}), 400,
        param="top_logprobs")
    assert_openai_error(http.post("/v1/completions", json={"model": "tiny", "prompt": [10 ** 9]}), 400,
                        param="prompt")


def test_unknown_route_is_openai_shaped_404(http):
    assert_openai_error(http.get("/v1/nothing-here"), 404)


def aborted_count(server) -> float:
    return server.engine.metrics.request_success.labels("tiny", "abort")._value.get()


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """A server whose requests can run for thousands of tokens, so that a client leaves while its request is still
    generating whatever the machine's speed: 8,000 tiny-model tokens take seconds, the 400 that fit `server` can
    finish in a tenth of a second on a fast core while the test's thread waits for the GIL."""
    model_path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-long"), family="llama", seed=0,
                                    max_position_embeddings=8192)
    with ServerThread(engine_config(model_path, max_model_len=8192, kv_cache_memory="64MiB")) as s:
        yield s


def stream_and_leave(server, body: dict) -> bool:
    """Read four chunks of a streamed chat, then leave; whether its request was still running when the client left."""
    with httpx.Client(base_url=server.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 4:
                break
        return server.core("has_unfinished_requests")


def test_disconnect_mid_stream_frees_kv(long_server):
    server = long_server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 8000, "temperature": 0, "stream": True, "ignore_eos": True}
    # 8,000 tokens take the engine seconds, but a test process that stalls longer (a garbage collection deep into
    # the suite) lets the request end before the client leaves, which tests nothing: then try again
    for _ in range(3):
        server.wait_idle()
        aborted = aborted_count(server)
        if stream_and_leave(server, body):
            break
    else:
        pytest.fail("the request ended before the client left, three times")
    t0 = time.monotonic()
    server.wait_idle(timeout=10)
    assert time.monotonic() - t0 < 5
    stats = server.engine.last_stats
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert_idle_and_empty(server)
    assert aborted_count(server) == aborted + 1


def test_disconnect_non_streamed_aborts(long_server):
    server = long_server
    server.wait_idle()
    aborted = aborted_count(server)
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 8000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    server.wait_idle(timeout=10)
    assert_idle_and_empty(server)
    assert aborted_count(server) == aborted + 1


def test_idle_engine_does_not_spin(server):
    """An idle engine process sleeps on its inbox (waking once a second for a health check); the frontend's
    reader thread sleeps on the socket."""
    server.wait_idle()
    pid = server.engine.process.pid
    reader = server.engine.process._reader.native_id

    def cpu_ticks(stat: str) -> int:
        with open(stat) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])   # utime + stime

    before = cpu_ticks(f"/proc/{pid}/stat"), cpu_ticks(f"/proc/self/task/{reader}/stat")
    time.sleep(1.0)
    after = cpu_ticks(f"/proc/{pid}/stat"), cpu_ticks(f"/proc/self/task/{reader}/stat")
    assert after[0] - before[0] <= 3   # clock ticks (1/100 s), all of the engine process's threads
    assert after[1] - before[1] <= 1


# ---- the edge: validation by param, Unicode, limits, the published schema ---------------------------------------
def test_core_side_invalid_request_is_400_with_its_param_and_code(server, client, monkeypatch):
    from kvflow.errors import InvalidRequestError

    def refuse(*_a, **_kw):
        raise InvalidRequestError("the prompt is too long, in words no substring check would match",
                                  param="prompt", code="context_length_exceeded")

    monkeypatch.setattr(server.engine, "submit", refuse)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "prompt" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client)
    assert e.value.body["param"] == "messages"        # the chat API's name for the prompt


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "a\udfffb"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages.0.content"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "\ud800"}, "model"),
])
def test_lone_surrogate_is_400_naming_the_field(http, route, body, param):
    raw = json.dumps({"max_tokens": 2, **body}).encode()        # ensure_ascii: the surrogate as a \\ud800 escape
    assert_openai_error(http.post(route, content=raw, headers={"content-type": "application/json"}), 400,
                        param=param)


@pytest.mark.parametrize("field, value", [
    ("stop_token_ids", [1000000]), ("stop_token_ids", [2 ** 70]), ("top_k", 10 ** 20), ("seed", 10 ** 30),
    ("temperature", 1e-300), ("logit_bias", {"x": 1}), ("logit_bias", {"1000000": 1}), ("n", 129),
    ("best_of", 3),
])
def test_values_the_engine_cannot_run_are_400(server, http, field, value):
    """Each of these once ended the engine loop or slipped through; now a 400 naming the field."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "min_tokens": 2, "temperature": 0.8, field: value}
    assert_openai_error(http.post("/v1/completions", json=body), 400, param=field)
    assert http.get("/health").status_code == 200
    assert server.engine.is_alive


def test_n_times_prompts_over_max_n_is_400(http):
    body = {"model": "tiny", "prompt": ["a"] * 65, "n": 2, "max_tokens": 2}
    err = assert_openai_error(http.post("/v1/completions", json=body), 400, param="prompt")
    assert "--max-n" in err["message"]


def test_logit_bias_reaches_the_engine(client):
    r = client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0,
                                  logit_bias={"42": 100, "7": -100})
    assert r.choices[0].finish_reason is not None


def test_logit_bias_keys_that_are_not_token_ids_are_a_400_listing_each(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       logit_bias={"42": 1, "x": 1, "1.5": 2, "": 3})
    err = e.value.body
    assert err["param"] == "logit_bias" and all(repr(k) in err["message"] for k in ("x", "1.5", "")), err
    assert "'42'" not in err["message"]


def test_responses_carry_the_keys_openai_sends_as_null(client):
    """Clients index these: `service_tier` on the response, `refusal`, `annotations`, `audio` and `function_call` on
    the chat message, each present and null."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    body = raw.http_response.json()
    assert body["service_tier"] is None
    message = body["choices"][0]["message"]
    assert all(key in message and message[key] is None for key in ("refusal", "annotations", "audio", "function_call"))
    parsed = raw.parse()
    assert parsed.service_tier is None and parsed.choices[0].message.refusal is None
    completion = client.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=2)
    assert "service_tier" in completion.http_response.json()


def test_continuous_usage_stats_on_every_chunk_the_first_with_no_completion_tokens(client):
    """vLLM's stream_options.continuous_usage_stats: usage on every chunk, the role chunk's with 0 completion tokens,
    the counts never decreasing, the last one the final usage."""
    for route in ("chat", "completions"):
        kw = dict(model="tiny", max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True},
                  stream_options={"include_usage": True, "continuous_usage_stats": True})
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "x"}], **kw)
                      if route == "chat" else client.completions.create(prompt="x", **kw))
        assert all(c.usage is not None for c in chunks), route
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 5, (route, counts)
        assert len({c.usage.prompt_tokens for c in chunks}) == 1 and chunks[0].usage.prompt_tokens > 0
        if route == "chat":
            assert chunks[0].choices[0].delta.role == "assistant" and counts[0] == 0


# text whose tokens end mid-character: emoji (4 bytes, some with joiners and modifiers), CJK, combining marks
MULTIBYTE = ["🙂", "👩‍👩‍👧", "👍🏽", "漢字かな", "한국어", "é", "ñ", "Ω≈ç√", "🇫🇷", "ॐ", "𝔘𝔫𝔦"]


def test_streamed_token_ids_are_the_whole_responses_and_the_text_their_decode(client, http):
    """Random prompts of multi-byte text (seeded): greedy, streamed and not, the streamed token ids are the whole
    response's, each once and in order, even where the detokenizer holds a token's text back, and the streamed text
    equals the whole text and the decode of those ids."""
    rng = random.Random(7)
    for case in range(12):
        prompt = "".join(rng.choice(MULTIBYTE + ["a", " ", "the "]) for _ in range(rng.randint(1, 12)))
        route = ("chat", "completions")[case % 2]
        kw = dict(model="tiny", max_tokens=24, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
        if route == "chat":
            call = lambda **k: client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **k)
        else:
            call = lambda **k: client.completions.create(prompt=prompt, **k)
        whole = call(**kw).choices[0]
        text = whole.message.content if route == "chat" else whole.text
        streamed_ids, streamed_text = [], ""
        for chunk in call(stream=True, **kw):
            for choice in chunk.choices:
                streamed_ids += choice.model_extra.get("token_ids") or []
                streamed_text += (choice.delta.content or "") if route == "chat" else choice.text
        assert streamed_ids == whole.token_ids and len(streamed_ids) == 24, (prompt, route)
        assert streamed_text == text, (prompt, route)
        assert http.post("/detokenize", json={"model": "tiny", "tokens": streamed_ids}).json()["prompt"] == text


def test_echoed_prompt_logprobs_list_each_prompt_token_first(client):
    """As vLLM: each position's top_logprobs starts with the token at that position (the prompt's under echo, then
    the sampled ones), then the top candidates by rank; token_id:N keys keep every entry apart."""
    r = client.completions.create(model="tiny", prompt="the cat sat on the mat again", echo=True, logprobs=2,
                                  max_tokens=3, temperature=0, extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert lp.top_logprobs[0] is None                    # the prompt's first token has no logprob
    for tok, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert next(iter(top)) == tok and top[tok] == value, (tok, top)
        ranked = list(top.values())[1:]
        assert ranked == sorted(ranked, reverse=True) and 2 <= len(top) <= 3


def test_truncation_side_picks_which_end_truncate_prompt_tokens_keeps(client, http):
    """vLLM's truncation_side: "left" (the default) keeps the prompt's last k tokens, "right" its first k."""
    text = "one two three four five six seven eight nine ten"
    ids = http.post("/tokenize", json={"model": "tiny", "prompt": text}).json()["tokens"]
    messages = [{"role": "user", "content": text}]
    chat_ids = http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
    for side, kept, kept_chat in ((None, ids[-4:], chat_ids[-4:]), ("left", ids[-4:], chat_ids[-4:]),
                                  ("right", ids[:4], chat_ids[:4])):
        extra = {"truncate_prompt_tokens": 4, "return_token_ids": True, **({"truncation_side": side} if side else {})}
        r = client.completions.create(model="tiny", prompt=text, max_tokens=1, extra_body=extra)
        assert r.usage.prompt_tokens == 4 and r.choices[0].prompt_token_ids == kept, side
        c = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, extra_body=extra)
        assert c.usage.prompt_tokens == 4 and c.prompt_token_ids == kept_chat, side
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=text, max_tokens=1, extra_body={"truncation_side": "middle"})
    assert e.value.body["param"] == "truncation_side"


def test_body_over_the_limit_is_413_before_parsing(http):
    big = b'{"prompt": "' + b"a" * (9 * 2 ** 20) + b'"}'
    err = assert_openai_error(http.post("/v1/completions", content=big,
                                        headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large"

    def chunks():       # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"a" * 2 ** 20
        yield b'"}'

    assert_openai_error(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}),
                        413)
    assert http.get("/health").status_code == 200


def test_deeply_nested_json_is_400(http):
    assert_openai_error(http.post("/v1/completions", content=b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}",
                                  headers={"content-type": "application/json"}), 400)


def test_huge_prompt_does_not_hold_the_event_loop(server, http):
    """Tokenizing a 4 MB prompt runs in a worker thread: /health keeps answering meanwhile."""
    result = {}

    def big():
        result["r"] = httpx.post(server.url + "/v1/completions", timeout=120,
                                 json={"model": "tiny", "prompt": "lorem ipsum dolor " * 230000, "max_tokens": 2})

    t = __import__("threading").Thread(target=big)
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert http.get("/health").status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    assert_openai_error(result["r"], 400)      # far over max_model_len
    assert worst < 1.0, worst


def test_a_chat_message_longer_than_any_context_is_refused_before_tokenizing(http):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "lorem ipsum " * 400000}], "max_tokens": 2}
    err = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param="messages")
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
    assert http.get("/health").status_code == 200


def test_openapi_document_matches_the_server(http):
    from kvflow import sampling_params as limits

    doc = http.get("/openapi.json").json()
    assert "422" not in json.dumps(doc["paths"])
    chat_op = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat_op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "text/event-stream" in chat_op["responses"]["200"]["content"]
    assert "content" not in doc["paths"]["/health"]["get"]["responses"]["200"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == \
        [__import__("kvflow.metrics").metrics.CONTENT_TYPE_LATEST]
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert props["temperature"]["maximum"] == limits.MAX_TEMPERATURE
    assert props["seed"]["maximum"] == limits.MAX_SEED and props["n"]["maximum"] == 128
    assert props["top_logprobs"]["maximum"] == limits.MAX_LOGPROBS
