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
from prometheus_client import generate_latest
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
    "vllm:request_generation_tokens", "vllm:iteration_tokens_total", "vllm:num_requests_waiting_by_reason",
    "vllm:cache_config_info", "vllm:request_params_n", "vllm:request_params_max_tokens",
    "vllm:request_max_num_generation_tokens", "vllm:request_inference_time_seconds", "vllm:request_num_preemptions",
    "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
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


@pytest.mark.slow
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
        if f.name == "vllm:cache_config_info":      # as vLLM's: the cache config's fields and the engine
            continue
        for s in f.samples:
            assert s.labels.get("model_name") == "tiny", s
    assert families["vllm:num_requests_waiting_by_reason"].type == "gauge"
    assert {s.labels["reason"] for s in families["vllm:num_requests_waiting_by_reason"].samples} == {
        "capacity", "deferred"}
    for name in ("vllm:request_params_n", "vllm:request_num_preemptions", "vllm:time_per_output_token_seconds"):
        assert families[name].type == "histogram", name
    # vLLM's buckets
    assert {s.labels["le"] for s in families["vllm:request_params_n"].samples if "le" in s.labels} == {
        "1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"}
    assert {s.labels["le"] for s in families["vllm:request_num_preemptions"].samples if "le" in s.labels} == {
        "1.0", "2.0", "3.0", "4.0", "5.0", "10.0", "20.0", "+Inf"}
    assert {s.labels["le"] for s in families["vllm:iteration_tokens_total"].samples if "le" in s.labels} == {
        *(f"{float(2 ** i)}" for i in (0, *range(3, 15))), "+Inf"}


def test_cache_config_info_says_the_kv_cache(server):
    text = httpx.get(server.url + "/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info")
    [sample] = family.samples
    labels = sample.labels
    assert sample.value == 1
    assert (labels["engine"], labels["block_size"], labels["cache_dtype"], labels["enable_prefix_caching"],
            labels["kv_cache_memory_bytes"]) == ("0", "16", "auto", "True", str(32 * 2 ** 20))
    # the tiny llama: 2 layers x 2 KV heads x 16 dims x fp32 x K,V = 512 bytes a token; 32 MiB of KV cache
    num_gpu_blocks = int(labels["num_gpu_blocks"])
    assert num_gpu_blocks == 32 * 2 ** 20 // (16 * 512)
    assert scrape(server)[("kvflow:kv_cache_bytes", ())] == num_gpu_blocks * 16 * 512
    # vLLM's capacity labels: max_model_len (the model card's 512) is 32 whole blocks, so the size in tokens is
    # every block's tokens and the concurrency that over max_model_len, written as str() of a float
    (card,) = httpx.get(server.base_url + "/models").json()["data"]
    assert card["max_model_len"] == 512
    assert labels["kv_cache_size_tokens"] == str(num_gpu_blocks * 16) == "65536"
    assert labels["kv_cache_max_concurrency"] == str(num_gpu_blocks * 16 / 512) == "128.0"


@pytest.mark.parametrize("num_blocks, max_model_len, size_tokens, max_concurrency", [
    (100, 512, "1600", "3.125"),        # 32 blocks a request: every block's tokens
    (100, 500, "1562", "3.125"),        # still 32 blocks (the last part full): 3.125 x 500 tokens, truncated
    (7, 4096, "112", "0.02734375"),     # not one request of max_model_len fits: vLLM says so, it does not round
])
def test_cache_config_info_capacity_is_vllms_arithmetic(num_blocks, max_model_len, size_tokens, max_concurrency):
    """vLLM's get_kv_cache_capacity: concurrency = blocks / cdiv(max_model_len, block_size), size in tokens =
    int(concurrency x max_model_len); the labels are their str(), per engine."""
    metrics = EngineMetrics("tiny", max_model_len=max_model_len)
    metrics.record_cache_config(EngineConfig(model="unused", block_size=16), num_blocks, num_engines=2)
    text = generate_latest(metrics.registry).decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info")
    assert [(s.labels["engine"], s.labels["kv_cache_size_tokens"], s.labels["kv_cache_max_concurrency"])
            for s in family.samples] == [("0", size_tokens, max_concurrency), ("1", size_tokens, max_concurrency)]


def completion_deltas(server, **request) -> tuple[object, callable]:
    """Send one completion on an idle server; its response and the metric deltas it caused."""
    server.wait_idle()
    before = scrape(server)
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    r = client.completions.create(model="tiny", **{"temperature": 0, **request})
    server.wait_idle()
    after = scrape(server)
    return r, lambda name, labels=(): after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


def test_one_request_counts_what_vllm_counts(server):
    r, delta = completion_deltas(server, prompt="Count my tokens, please", max_tokens=7,
                                 extra_body={"ignore_eos": True})
    prompt = r.usage.prompt_tokens
    # vLLM's iteration_tokens_total: the step of the first token observes the whole prompt plus that token,
    # then one observation of 1 per decode step (vLLM's own test: sum prompt + max_tokens, count max_tokens)
    assert delta("vllm:iteration_tokens_total_sum") == prompt + 7
    assert delta("vllm:iteration_tokens_total_count") == 7
    assert delta("vllm:iteration_tokens_total_bucket", (("le", "1.0"),)) == 6
    assert delta("vllm:request_params_n_count") == 1 and delta("vllm:request_params_n_sum") == 1
    assert delta("vllm:request_params_max_tokens_sum") == 7
    assert delta("vllm:request_max_num_generation_tokens_sum") == 7
    assert delta("vllm:request_num_preemptions_count") == 1 and delta("vllm:request_num_preemptions_sum") == 0
    # the older name observes exactly what inter_token_latency does
    assert delta("vllm:time_per_output_token_seconds_count") == delta("vllm:inter_token_latency_seconds_count") == 6
    assert delta("vllm:time_per_output_token_seconds_sum") == pytest.approx(
        delta("vllm:inter_token_latency_seconds_sum"))
    # the RUNNING phase is the PREFILL phase and the DECODE phase
    assert delta("vllm:request_inference_time_seconds_count") == 1
    assert delta("vllm:request_inference_time_seconds_sum") == pytest.approx(
        delta("vllm:request_prefill_time_seconds_sum") + delta("vllm:request_decode_time_seconds_sum"))
    assert delta("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        delta("vllm:request_decode_time_seconds_sum") / 6)
    # queue time starts when the core queued it, after the server's receipt: within the time to first token
    assert 0 <= delta("vllm:request_queue_time_seconds_sum") <= delta("vllm:time_to_first_token_seconds_sum")


def test_n_choices_count_as_vllm_child_requests(server):
    r, delta = completion_deltas(server, prompt="Three ways to say it", max_tokens=5, n=3, temperature=1.0, seed=3,
                                 extra_body={"ignore_eos": True})
    prompt = r.usage.prompt_tokens
    assert delta("vllm:request_params_n_count") == 1 and delta("vllm:request_params_n_sum") == 3
    assert delta("vllm:request_params_n_bucket", (("le", "2.0"),)) == 0
    assert delta("vllm:request_max_num_generation_tokens_count") == 1
    assert delta("vllm:request_max_num_generation_tokens_sum") == 5
    # per choice, as vLLM's child requests: each one's prompt, its max_tokens, its tokens
    assert delta("vllm:request_params_max_tokens_count") == 3
    assert delta("vllm:request_prompt_tokens_count") == 3
    assert delta("vllm:prompt_tokens_total") == 3 * prompt
    assert delta("vllm:iteration_tokens_total_sum") == 3 * (prompt + 5)


def test_absent_max_tokens_is_observed_resolved(server):
    server.wait_idle()
    before = scrape(server)
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    # chat: no max_tokens (completions default to 16, as OpenAI's); one token, then stop
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Stop at once"}],
                                       temperature=0, logit_bias={"123": 100}, extra_body={"stop_token_ids": [123]})
    server.wait_idle()
    after = scrape(server)
    assert r.usage.completion_tokens == 1
    # what vLLM's server resolves it to: the room left in the context (max_model_len 512)
    name = "vllm:request_params_max_tokens_sum"
    assert after[(name, ())] - before[(name, ())] == 512 - r.usage.prompt_tokens


@pytest.mark.slow
def test_per_request_preemptions_add_up_to_the_engine_counter(tmp_path):
    path = make_tiny_hf_model(tmp_path / "tiny", family="llama", seed=2)
    # 12 blocks of 16 tokens (512 bytes a token): 16 requests of up to 75 tokens must preempt one another
    cfg = EngineConfig(model=str(path), dtype="float32", max_model_len=128, kv_cache_memory=12 * 16 * 512,
                       enable_prefix_caching=False, served_model_name="tiny")
    prompts = [[(i * 37 + j) % 40000 + 10 for j in range(20 + i)] for i in range(16)]

    async def load(base_url):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(client.completions.create(
                model="tiny", prompt=p, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
                for p in prompts))
        finally:
            await client.close()

    with ServerThread(cfg) as s:
        asyncio.run(load(s.base_url))
        s.wait_idle()
        after = scrape(s)
    preemptions = after[("vllm:num_preemptions_total", ())]
    assert preemptions > 0
    assert after[("vllm:request_num_preemptions_count", ())] == 16
    assert after[("vllm:request_num_preemptions_sum", ())] == preemptions
    assert after[("vllm:request_num_preemptions_bucket", (("le", "+Inf"),))] == 16


@pytest.mark.slow
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
    # as vLLM counts: each prompt once, whole, and every generated token (not the chunks the model computed)
    assert delta("vllm:iteration_tokens_total_sum") == sum(u.prompt_tokens for u in usages) + 32 * 48
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
                                      finish_reasons=["stop"], timings=[t], n=1, max_tokens=16))
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
    assert samples[("vllm:request_inference_time_seconds_sum", (("model_name", "a"),))] == pytest.approx(2.5)
    assert samples[("vllm:time_per_output_token_seconds_count", (("model_name", "a"),))] == 2
    assert samples[("vllm:request_params_max_tokens_sum", (("model_name", "a"),))] == 16
    # the core's queue entry, when an output said, starts the queue time instead of the server's receipt
    queued = RequestTimings(arrival=100.0, queued=100.2, scheduled=100.5, num_preemptions=2)
    a.record_finished(FinishedRequest("q", "a", prompt_tokens=10, cached_tokens=0, completion_tokens=0,
                                      finish_reasons=["abort"], timings=[queued]))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(a.render().decode()) for s in f.samples}
    assert samples[("vllm:request_queue_time_seconds_sum", (("model_name", "a"),))] == pytest.approx(0.5 + 0.3)
    assert samples[("vllm:request_num_preemptions_sum", (("model_name", "a"),))] == 2
    # a prompt that produced no output is not counted as processed (vLLM counts it at the first output)
    assert samples[("vllm:prompt_tokens_total", (("model_name", "a"),))] == 10
    assert samples[("vllm:request_prompt_tokens_count", (("model_name", "a"),))] == 2
    assert "vllm:prompt_tokens_total" in b.render().decode()


def test_a_step_without_outputs_observes_no_iteration_tokens():
    m = EngineMetrics("m")
    m.record_step(StepStats(num_running=1, batch_size=1, num_batched_tokens=64))    # a prompt chunk, no token yet
    m.record_step(StepStats(num_running=1, batch_size=1, num_batched_tokens=36, iteration_tokens=101))
    samples = {s.name: s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples
               if f.name == "vllm:iteration_tokens_total" and "le" not in s.labels}
    assert samples == {"vllm:iteration_tokens_total_count": 1, "vllm:iteration_tokens_total_sum": 101}
