"""Prometheus metrics at /metrics (vLLM's names), the periodic stats log line, the request log."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.config import EngineConfig
from kvflow.core.outputs import StepStats
from kvflow.metrics import EngineMetrics, FinishedRequest, RequestTimings
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

VLLM_METRICS = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
]
KVFLOW_METRICS = ["kvflow:step_batch_size", "kvflow:step_duration_seconds", "kvflow:process_resident_memory_bytes",
                  "kvflow:weights_bytes", "kvflow:kv_cache_bytes"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-metrics"), family="llama", seed=2)
    cfg = EngineConfig(model=str(path), dtype="float32", max_model_len=512, kv_cache_memory="32MiB",
                       max_num_seqs=64, served_model_name="tiny")
    log = tmp_path_factory.mktemp("reqlog") / "requests.jsonl"
    with ServerThread(cfg, request_log=str(log)) as s:
        s.request_log_path = log
        yield s


def scrape(server) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without model_name): value} from the real /metrics page."""
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def test_metrics_page_parses_and_has_vllm_names(server):
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in VLLM_METRICS + KVFLOW_METRICS:
        assert name in families, name
    samples = scrape(server)
    assert ("vllm:prompt_tokens_total", ()) in samples
    assert ("vllm:num_preemptions_total", ()) in samples
    assert ("vllm:request_success_total", (("finished_reason", "stop"),)) in samples
    assert samples[("kvflow:weights_bytes", ())] > 0
    assert samples[("kvflow:kv_cache_bytes", ())] > 0
    assert samples[("kvflow:process_resident_memory_bytes", ())] > 10 * 2 ** 20
    for f in families.values():
        for s in f.samples:
            assert s.labels.get("model_name") == "tiny", s


def test_metrics_under_load_match_usage(server):
    server.wait_idle()
    before = scrape(server)
    seen = {"running": 0.0, "kv": 0.0}
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            s = scrape(server)
            seen["running"] = max(seen["running"], s[("vllm:num_requests_running", ())])
            seen["kv"] = max(seen["kv"], s[("vllm:kv_cache_usage_perc", ())])
            time.sleep(0.01)

    async def one(client, i):
        t0 = time.perf_counter()
        r = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Q{i}: write a haiku about {i}"}],
            max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
        return r.usage, time.perf_counter() - t0

    async def load():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        results = asyncio.run(load())
    finally:
        stop.set()
        poller.join()
    server.wait_idle()
    after = scrape(server)

    def delta(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert seen["running"] > 1
    assert seen["kv"] > 0
    assert after[("vllm:num_requests_running", ())] == 0
    assert after[("vllm:num_requests_waiting", ())] == 0
    assert after[("vllm:kv_cache_usage_perc", ())] == 0
    assert after[("vllm:gpu_cache_usage_perc", ())] == 0
    usages = [u for u, _ in results]
    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages) == 32 * 48
    assert delta("vllm:request_success_total", (("finished_reason", "length"),)) == 32
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens"):
        assert delta(hist + "_count") == 32, hist
    assert delta("vllm:inter_token_latency_seconds_count") == 32 * 47
    assert delta("vllm:request_generation_tokens_sum") == 32 * 48
    assert delta("vllm:iteration_tokens_total_sum") >= 32 * 48   # prefill chunks + one token per decode
    assert delta("vllm:prefix_cache_queries_total") > 0
    # the engine ran more than one request in some step
    assert delta("kvflow:step_batch_size_count") > 0
    assert delta("kvflow:step_batch_size_sum") / delta("kvflow:step_batch_size_count") > 1
    # TTFT counts from the server's receipt: never more than the client-side latency
    ttft_sum = delta("vllm:time_to_first_token_seconds_sum")
    assert 0 < ttft_sum <= sum(lat for _, lat in results)


def test_request_log_lines(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    r = client.completions.create(model="tiny", prompt="log me", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    server.wait_idle()
    lines = [json.loads(x) for x in server.request_log_path.read_text().splitlines()]
    entry = next(e for e in lines if e["id"] == r.id)
    assert entry == {**entry, "model": "tiny", "prompt_tokens": r.usage.prompt_tokens,
                     "cached_tokens": r.usage.prompt_tokens_details.cached_tokens, "completion_tokens": 5,
                     "finish_reason": "length", "error": None}
    assert 0 <= entry["queue_time"] <= entry["ttft"] <= entry["e2e"]


def test_periodic_log_line(caplog):
    m = EngineMetrics("m", log_stats_interval=0.0)
    stats = StepStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_preemptions=1,
                      prefix_cache_queries=100, prefix_cache_hits=40, num_prompt_tokens_computed=60,
                      num_generated_tokens=3, batch_size=3, num_batched_tokens=63, duration_s=0.01)
    with caplog.at_level(logging.INFO, logger="kvflow.metrics"):
        time.sleep(0.01)
        m.record_step(stats)
    line = caplog.records[-1].getMessage()
    for part in ("prompt throughput", "generation throughput", "running 3 reqs", "waiting 2 reqs",
                 "KV cache usage 25.0%", "prefix cache hit rate 40.0%", "preemptions 1"):
        assert part in line, line


def test_private_registries_and_finished_request_metrics():
    a, b = EngineMetrics("a"), EngineMetrics("b")   # two servers in one process do not collide
    t = RequestTimings(arrival=100.0, scheduled=100.5, first_token=101.0, last_token=103.0, finished=103.0,
                       token_times=[101.0, 102.0, 103.0])
    a.record_finished(FinishedRequest("r", "a", prompt_tokens=10, cached_tokens=4, completion_tokens=3,
                                      finish_reasons=["stop"], timings=[t]))
    text = a.render().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("vllm:time_to_first_token_seconds_sum", (("model_name", "a"),))] == pytest.approx(1.0)
    assert samples[("vllm:request_queue_time_seconds_sum", (("model_name", "a"),))] == pytest.approx(0.5)
    assert samples[("vllm:request_prefill_time_seconds_sum", (("model_name", "a"),))] == pytest.approx(0.5)
    assert samples[("vllm:request_decode_time_seconds_sum", (("model_name", "a"),))] == pytest.approx(2.0)
    assert samples[("vllm:inter_token_latency_seconds_count", (("model_name", "a"),))] == 2
    assert samples[("vllm:e2e_request_latency_seconds_sum", (("model_name", "a"),))] == pytest.approx(3.0)
    assert samples[("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", "a")))] == 1
    assert "vllm:prompt_tokens_total" in b.render().decode()
