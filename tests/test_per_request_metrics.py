"""vLLM's --enable-per-request-metrics over real HTTP with the official `openai` client: chat and completion
responses carry `metrics` (vLLM's field names, milliseconds), consistent with each other and with the wall clock;
a stream carries them on its usage chunk only; n > 1 carries none. (Without the flag no response has the key:
tests/test_server.py.)"""
from __future__ import annotations

import time

import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

FIELDS = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-metrics"), family="llama", seed=2)
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory="8MiB",
                          served_model_name="tiny", enforce_eager=True)
    with ServerThread(config, enable_per_request_metrics=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


def check(metrics: dict, num_tokens: int, wall_ms: float) -> None:
    assert set(metrics) == FIELDS, metrics
    ttft, gen, queue = metrics["time_to_first_token_ms"], metrics["generation_time_ms"], metrics["queue_time_ms"]
    assert ttft > 0 and gen > 0 and queue >= 0
    assert queue + ttft + gen <= wall_ms       # all inside the request's own time
    assert metrics["mean_itl_ms"] == pytest.approx(gen / (num_tokens - 1))
    assert metrics["tokens_per_second"] == pytest.approx(num_tokens / ((ttft + gen) / 1000))


def timed(call):
    start = time.perf_counter()
    out = call()
    return out, (time.perf_counter() - start) * 1000


def test_a_chat_and_a_completion_carry_vllms_metrics(client):
    chat, wall = timed(lambda: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True}))
    assert chat.usage.completion_tokens == 8
    check(chat.model_extra["metrics"], 8, wall)
    completion, wall = timed(lambda: client.completions.create(model="tiny", prompt="Once upon", max_tokens=6,
                                                               extra_body={"ignore_eos": True}))
    check(completion.model_extra["metrics"], 6, wall)


def test_a_stream_carries_them_on_its_usage_chunk_only(client):
    chunks, wall = timed(lambda: list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})))
    assert all("metrics" not in c.model_extra for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    check(chunks[-1].model_extra["metrics"], 8, wall)
    plain = list(client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, stream=True,
                                           extra_body={"ignore_eos": True}))
    assert all("metrics" not in c.model_extra for c in plain)        # no usage chunk, no metrics (as vLLM)


def test_n_above_one_carries_none(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2)
    assert len(r.choices) == 2 and "metrics" not in r.model_extra
