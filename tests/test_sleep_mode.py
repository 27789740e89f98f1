"""Sleep mode over HTTP (vLLM's /sleep, /wake_up, /is_sleeping with --enable-sleep-mode; llama-server's
--sleep-idle-seconds) and offline (LLM.sleep / LLM.wake_up): the engine process's memory really goes (its RSS, read
from /proc), what comes back answers token for token as before (greedy), requests in flight are drained, and a request
to a sleeping engine gets a 503 with Retry-After (explicit sleep) or wakes it (idle sleep)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

# a prompt long enough that its KV blocks are tens of MiB resident (4 KiB a token in this model)
LONG_PROMPT = [100 + (i * 37) % 40000 for i in range(3500)]
PROMPTS = [[1, 450, 4996, 17354, 1701], [1, 9038, 2501, 263, 931], LONG_PROMPT]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    # 4 layers x 4 KV heads x 32: 4 KiB of KV a token; ~26 MiB of float32 weights (mostly the tied embedding)
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-sleep"), family="llama", seed=3, hidden_size=128,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                              max_position_embeddings=4096)


def _config(model_path, **kw) -> EngineConfig:
    return EngineConfig(model=str(model_path), dtype="float32", max_model_len=4096, kv_cache_memory="64MiB",
                        max_num_seqs=4, **kw)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    server = ServerThread(_config(model_path, enable_sleep_mode=True),
                          batch_dir=str(tmp_path_factory.mktemp("batches"))).start()
    yield server
    server.stop()


def rss(pid: int) -> int:
    """The process's resident bytes (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def greedy(server, prompts=PROMPTS, max_tokens: int = 12) -> list[list[int]]:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    out = []
    for ids in prompts:
        r = client.completions.create(model=server.engine.served_model_name, prompt=ids, max_tokens=max_tokens,
                                      temperature=0, extra_body={"return_token_ids": True})
        out.append(r.choices[0].token_ids)
    return out


def sleep_state(http) -> dict[str, float]:
    """vllm:engine_sleep_state's series by sleep_state label."""
    values = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm:engine_sleep_state{"):
            state = line.split('sleep_state="')[1].split('"')[0]
            values[state] = float(line.rsplit(" ", 1)[1])
    return values


def kv_bytes_per_token(server) -> float:
    ready = server.engine.process.ready
    return ready.kv_cache_bytes / (ready.num_blocks * server.engine.config.block_size)


def test_level_1_releases_the_kv_cache_and_wakes_to_the_same_answers(server):
    before = greedy(server)
    assert len({tuple(t) for t in before}) == len(before)        # the prompts' answers differ: a test that can fail
    pid = server.engine.process.pid
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert sleep_state(http) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
        rss_awake = rss(pid)
        assert http.post("/sleep", params={"level": 1}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert sleep_state(http) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
        released = rss_awake - rss(pid)
        # at least the long prompt's KV blocks, which were resident (the cache's pages count once written)
        assert released >= 0.8 * len(LONG_PROMPT) * kv_bytes_per_token(server), released

        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping"
        assert int(r.headers["Retry-After"]) > 0

        assert http.post("/wake_up").status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert sleep_state(http)["awake"] == 1
    assert greedy(server) == before
    server.core("check")


def test_level_2_releases_the_weights_and_reloads_them(server):
    before = greedy(server)
    pid = server.engine.process.pid
    with httpx.Client(base_url=server.url, timeout=60) as http:
        rss_awake = rss(pid)
        assert http.post("/sleep?level=2").status_code == 200
        assert sleep_state(http) == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
        released = rss_awake - rss(pid)
        assert released >= 0.8 * server.engine.process.ready.weights_bytes, released
        assert server.core("sleep_state") == {"level": 2, "sleeping": ["kv_cache", "weights"]}

        # vLLM's tags: the weights first, the engine still asleep until the KV cache is back too
        assert http.post("/wake_up?tags=weights").status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert server.core("sleep_state") == {"level": 2, "sleeping": ["kv_cache"]}
        assert http.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert greedy(server) == before
    server.core("check")


def test_requests_in_flight_finish_before_the_engine_sleeps(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    got = {}

    def stream():
        chunks = client.completions.create(model=server.engine.served_model_name, prompt="drain me", max_tokens=300,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        got["chunks"] = [c for c in chunks if c.choices]

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 30
    while not server.engine._streams and time.monotonic() < deadline:
        time.sleep(0.005)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/sleep").status_code == 200       # returns once the stream is done and the engine sleeps
        assert not server.engine._streams
        t.join(30)
        assert got["chunks"][-1].choices[0].finish_reason == "length"
        assert sum(len(c.choices[0].text) > 0 for c in got["chunks"]) > 100      # whole: none cut
        assert http.post("/wake_up").status_code == 200


def test_batch_lines_wait_for_the_engine_to_wake(server):
    """The Batch API's worker takes a sleeping engine's 503 as "later" (as a full queue's 429), not as a shutdown
    (which pauses it until the next start)."""
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": server.engine.served_model_name, "prompt": "wait for me", "max_tokens": 4}}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/sleep").status_code == 200
        f = client.files.create(file=("asleep.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        time.sleep(2.5)                 # the worker has been told 503 engine_sleeping at least once
        assert client.batches.retrieve(batch.id).request_counts.completed == 0
        assert http.post("/wake_up").status_code == 200
    deadline = time.monotonic() + 60
    while (b := client.batches.retrieve(batch.id)).status != "completed" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b.status == "completed" and b.request_counts.completed == 1


def test_bad_values_are_refused_by_name(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for query, param in (("level=3", "level"), ("level=x", "level"), ("mode=keep", "mode"),
                             ("levels=1", "levels")):
            r = http.post(f"/sleep?{query}")
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (query, r.text)
        r = http.post("/wake_up?tags=optimizer")
        assert r.status_code == 400 and r.json()["error"]["param"] == "tags"
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_idle_sleep_wakes_for_the_next_request_and_routes_need_the_flag(model_path):
    server = ServerThread(_config(model_path), sleep_idle_seconds=1).start()
    try:
        before = greedy(server)
        pid = server.engine.process.pid
        rss_awake = rss(pid)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            # vLLM answers 404 where its sleep routes are not mounted
            assert http.post("/sleep").status_code == 404
            assert http.get("/is_sleeping").status_code == 404
            deadline = time.monotonic() + 30
            while server.core("sleep_state")["level"] != 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert server.core("sleep_state")["level"] == 2
            assert sleep_state(http)["discard_all"] == 1
            assert rss_awake - rss(pid) >= 0.8 * server.engine.process.ready.weights_bytes
        assert greedy(server) == before          # answered, not refused: the first request woke the engine
        assert server.core("sleep_state")["level"] == 0
    finally:
        server.stop()


def test_offline_llm_sleeps_and_wakes(model_path):
    from kvflow import LLM, SamplingParams

    with LLM(str(model_path), dtype="float32", max_model_len=4096, kv_cache_memory="64MiB",
             enable_sleep_mode=True) as llm:
        params = SamplingParams(max_tokens=12, temperature=0)
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
        for level in (1, 2):
            llm.sleep(level)
            assert llm.is_sleeping()
            with pytest.raises(RuntimeError, match="sleeping"):
                llm.generate(PROMPTS[:1], params)
            llm.wake_up()
            assert not llm.is_sleeping()
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)] == before
    with LLM(str(model_path), dtype="float32", max_model_len=4096, kv_cache_memory="16MiB") as llm:
        with pytest.raises(ValueError, match="enable_sleep_mode"):
            llm.sleep()


def test_a_hybrid_releases_its_recurrent_state_and_answers_the_same(tmp_path):
    """LFM2 (short convolutions beside attention): level 1 drops the state tensors with the KV cache; the state
    slots come back zeroed with the plan of the load, and the answers are the same."""
    from kvflow import LLM, SamplingParams

    path = make_tiny_hf_model(tmp_path, family="lfm2", seed=1)
    with LLM(str(path), dtype="float32", max_model_len=512, kv_cache_memory="16MiB", enable_sleep_mode=True) as llm:
        params = SamplingParams(max_tokens=12, temperature=0)
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
        runner = llm.engine.runner
        llm.sleep(1)
        assert all(not layer.states for layer in runner.state_layers)
        llm.wake_up()
        assert all(t.abs().sum() == 0 for layer in runner.state_layers for t in layer.states.values())
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)] == before
