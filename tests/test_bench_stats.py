"""`kvflow bench` pieces against hand-computed values: percentiles, TPOT, ITL spreading, goodput, cost, /metrics
parsing, workloads, launch command building; results.json read back and written again."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from kvflow.bench.client import RequestRecord, split_tokens, spread_token_times
from kvflow.bench.cli import parse_sweep
from kvflow.bench.launcher import build_argv, parse_vary, variants
from kvflow.bench.metrics_sampler import parse_metrics, summarize_series
from kvflow.bench.stats import distribution, meets_slo, parse_slo, percentile, summarize
from kvflow.bench.report import findings, load_result, markdown_report, table_rows
from kvflow.bench.result import (BenchMeta, BenchResult, ClientHost, ClientStats, CommandSettings, ExperimentMeta,
                                 ExperimentResult, Load, RunResult, Sweep, VariantResult, Warmup, WorkloadInfo,
                                 result_from_json)
from kvflow.bench.workloads import (haiku_workload, jsonl_workload, quote_workload, random_workload,
                                     shared_prefix_workload, write_jsonl)


def test_percentile_interpolates_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)      # pos (4-1)*0.9 = 2.7 -> 3 + 0.7*(4-3)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 95) == 7.0 and percentile([], 50) is None
    d = distribution([0.001, 0.002, 0.003])                # seconds in, ms out
    assert d.mean == pytest.approx(2.0) and d.p50 == pytest.approx(2.0) and d.p90 == pytest.approx(2.8)


def test_tpot_and_itl_of_a_record():
    r = RequestRecord(index=0, send_time=0.0, success=True, ttft=0.1, e2e=0.75,
                      token_times=[0.1, 0.2, 0.4, 0.7], output_tokens=4)
    assert r.tpot == pytest.approx(0.2)                    # (0.7 - 0.1) / (4 - 1)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert sum(r.itls) / len(r.itls) == pytest.approx(r.tpot)
    one = RequestRecord(index=1, send_time=0.0, success=True, ttft=0.1, e2e=0.1, token_times=[0.1], output_tokens=1)
    assert one.tpot is None and one.itls == []


def test_multi_token_chunks_are_spread():
    # 7 tokens over 3 chunks of 2, 6, 2 characters: one each, the 4 extra in proportion (0.8, 2.4, 0.8)
    # -> floors (0, 2, 0), the 2 left to the largest remainders (chunks 0 and 2)
    assert split_tokens(["ab", "abcdef", "ab"], 7) == [2, 3, 2]
    assert split_tokens(["a", "b"], 2) == [1, 1]
    assert split_tokens(["a", "b", "c"], 2) == [1, 1, 1]   # fewer tokens reported than chunks: one each
    assert split_tokens([], 5) == []
    # chunk 0's tokens at its time; chunk 1's 3 tokens evenly over (0.1, 0.4]
    assert spread_token_times([0.1, 0.4], [2, 3]) == pytest.approx([0.1, 0.1, 0.2, 0.3, 0.4])
    times = spread_token_times([0.1, 0.4, 0.5], [1, 3, 1])
    r = RequestRecord(index=0, send_time=0, success=True, ttft=0.1, e2e=0.5, token_times=times, output_tokens=5)
    assert r.itls == pytest.approx([0.1, 0.1, 0.1, 0.1])   # per token, not per chunk (0.3 then 0.1)


def _rec(i, send, ttft, e2e, out, prompt, success=True, kind=None):
    times = [ttft + k * (e2e - ttft) / max(out - 1, 1) for k in range(out)] if success else []
    return RequestRecord(index=i, send_time=send, success=success, ttft=ttft if success else None, e2e=e2e,
                         token_times=times, output_tokens=out if success else 0, prompt_tokens=prompt,
                         error_kind=kind)


def _meta(**changes) -> BenchMeta:
    meta = BenchMeta(command="kvflow bench --sweep request-rate=2,inf", kvflow_version="0.1.0",
                     started_at="2026-01-01T00:00:00+00:00", finished_at="2026-01-01T00:01:00+00:00",
                     base_url="http://127.0.0.1:8000/v1", api="chat", model="m", server_models=["m"],
                     server_version={"version": "1"}, seed=0, workload=WorkloadInfo("random", {"input_len": 8}),
                     ignore_eos=True, temperature=0.0, warmup=1, timeout_s=600.0, slo={"ttft": 0.2},
                     cost_per_hour=3.6, sweep=Sweep("request_rate", [2.0, math.inf]),
                     client_host=ClientHost(python="3.11.7", platform="Linux", machine="x86_64"))
    return dataclasses.replace(meta, **changes)


def _run(label, server, records=None, rate=math.inf, series=(), keep_text=False, slo=None, cost=None) -> RunResult:
    """A run of `records` (one request of 10 tokens in 1 s by default) whose server summed up as `server`."""
    records = [_rec(0, 0.0, 0.1, 1.0, 10, 5)] if records is None else records
    return RunResult(label=label, load=Load(concurrency=None, request_rate=rate, num_requests=len(records),
                                            duration_limit_s=None),
                     started_at="2026-01-01T00:00:00+00:00", finished_at="2026-01-01T00:00:02+00:00",
                     summary=summarize(records, slo, cost), server=server, server_series=list(series),
                     client=ClientStats(cpu_seconds=0.1, wall_seconds=2.0, cpu_fraction=0.05, max_rss_bytes=1 << 26),
                     warmup=Warmup(requests=1, failed=0), records=records, keep_text=keep_text)


def _bench(runs: list[RunResult]) -> BenchResult:
    return BenchResult(meta=_meta(), runs=runs)


def test_summary_throughput_goodput_cost():
    recs = [_rec(0, 0.0, 0.1, 1.0, 10, 5),                 # TPOT 0.9/9 = 0.1
            _rec(1, 0.5, 0.3, 1.5, 10, 7),                 # ends at 2.0; TPOT 1.2/9
            _rec(2, 0.2, None, 0.01, 0, 9, success=False, kind="http_400")]
    s = summarize(recs, slo=parse_slo("ttft=200ms"), cost_per_hour=3.6)
    assert s.duration_s == pytest.approx(2.0)              # first send 0.0 -> last end 2.0
    assert (s.completed, s.failed) == (2, 1)
    assert s.errors_by_kind == {"http_400": 1}
    assert s.request_throughput == pytest.approx(1.0)
    assert s.input_throughput == pytest.approx(6.0)        # (5 + 7) / 2: failed requests' prompts don't count
    assert s.output_throughput == pytest.approx(10.0)
    assert s.ttft_ms.mean == pytest.approx(200.0)
    assert s.tpot_ms.p50 == pytest.approx((100.0 + 1200 / 9) / 2)
    assert s.e2e_ms.p50 == pytest.approx(1250.0)
    assert s.slo.good_requests == 1 and s.slo.goodput == pytest.approx(0.5)
    assert s.slo.good_fraction == pytest.approx(1 / 3)
    assert s.cost.run_dollars == pytest.approx(0.002)      # $3.6/h for 2 s
    assert s.cost.per_million_output_tokens == pytest.approx(100.0)
    assert s.cost.per_successful_request == pytest.approx(0.001)


def test_slo_parsing_and_checks():
    assert parse_slo("ttft=500ms, tpot=0.05,e2e=2s") == {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0}
    assert parse_slo(None) == {}
    with pytest.raises(ValueError, match="bad --slo"):
        parse_slo("latency=3")
    r = _rec(0, 0.0, 0.1, 1.0, 10, 5)
    assert meets_slo(r, {"tpot": 0.1}) and not meets_slo(r, {"tpot": 0.099})
    assert meets_slo(r, {"ttft": 0.1, "e2e": 1.0}) and not meets_slo(r, {"e2e": 0.99})
    assert not meets_slo(_rec(1, 0, None, 0.1, 0, 1, success=False, kind="timeout"), {})


METRICS_TEXT = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3
vllm:num_requests_running{model_name="b"} 2
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="a"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="a"} 100
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="a"} 40
# TYPE kvflow:step_duration_seconds histogram
kvflow:step_duration_seconds_bucket{le="+Inf",model_name="a"} 10
kvflow:step_duration_seconds_count{model_name="a"} 10
kvflow:step_duration_seconds_sum{model_name="a"} 1.5
"""


def test_parse_metrics_with_fallback_names():
    m = parse_metrics(METRICS_TEXT)
    assert m == {"running": 5.0, "kv_cache_usage": 0.25, "prefix_cache_queries": 100.0, "prefix_cache_hits": 40.0,
                 "step_seconds": 1.5}
    series = [{"t": 0.0, **m}, {"t": 2.0, **m, "running": 1.0, "prefix_cache_queries": 200.0,
                                "prefix_cache_hits": 115.0, "step_seconds": 2.5}]
    s = summarize_series(series)
    assert s.prefix_cache.hit_rate == pytest.approx(0.75)      # (115 - 40) / (200 - 100)
    assert s.engine_busy.fraction == pytest.approx(0.5)        # 1.0 s of steps in 2.0 s
    assert s.running.mean == pytest.approx(3.0) and s.running.max == 5.0
    assert summarize_series([], available=False, error="HTTP 404").to_json() == {"available": False,
                                                                                   "error": "HTTP 404"}


def test_parse_metrics_reads_llama_server_names():
    text = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.5
"""
    assert parse_metrics(text) == {"running": 4.0, "waiting": 2.0, "kv_cache_usage": 0.5}


def test_workloads_are_seeded_and_sized(tmp_path):
    a, b = random_workload(20, 50, 16, 0.5, seed=3), random_workload(20, 50, 16, 0.5, seed=3)
    assert [s.prompt for s in a.specs] == [s.prompt for s in b.specs]
    assert all(25 <= len(s.prompt.split()) <= 75 and 8 <= s.max_tokens <= 24 for s in a.specs)
    assert all(s.prompt_tokens_est == len(s.prompt.split()) for s in a.specs)
    assert [s.prompt for s in random_workload(5, 50, 16, seed=4).specs] != [s.prompt for s in a.specs[:5]]
    sp = shared_prefix_workload(3, 4, 40, 10, 8, seed=0)
    assert len(sp.specs) == 12 and len({s.messages[0]["content"] for s in sp.specs}) == 3
    assert len(sp.specs[0].messages[0]["content"].split()) == 40
    h = haiku_workload()
    assert len(h.specs) == 32 and h.specs[5].prompt == "Q5: write a haiku" and h.specs[5].max_tokens == 64
    assert [s.index for s in h.take(40)][-1] == 39 and list(h.take(40))[33].prompt == "Q1: write a haiku"
    f = tmp_path / "w.jsonl"
    f.write_text(json.dumps({"prompt": "a b c", "max_tokens": 4}) + "\n\n" + json.dumps("plain prompt") + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    j = jsonl_workload(f, default_max_tokens=9)
    assert [(s.prompt, s.max_tokens) for s in j.specs[:2]] == [("a b c", 4), ("plain prompt", 9)]
    assert j.specs[2].as_prompt() == "user: hi"
    f.write_text('{"max_tokens": 3}\n')
    with pytest.raises(ValueError, match="w.jsonl:1"):
        jsonl_workload(f)


SPEC_METRICS = """# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{model_name="a"} %d
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{model_name="a"} %d
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{model_name="a"} %d
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="0"} %d
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="1"} %d
"""


def test_spec_decode_counters_become_acceptance_rate_and_mean_accepted_length():
    before = parse_metrics(SPEC_METRICS % (10, 20, 12, 8, 4))
    assert before == {"spec_drafts": 10.0, "spec_draft_tokens": 20.0, "spec_accepted_tokens": 12.0,
                      "spec_accepted_pos_0": 8.0, "spec_accepted_pos_1": 4.0}
    after = parse_metrics(SPEC_METRICS % (50, 100, 72, 38, 34))
    s = summarize_series([{"t": 0.0, **before}, {"t": 1.0, **after}])
    # 40 drafts of 80 tokens, 60 accepted: 75 %, 1 + 60 / 40 = 2.5 tokens per verifying step
    sd = s.spec_decode
    assert sd.num_drafts == 40 and sd.num_draft_tokens == 80
    assert sd.acceptance_rate == pytest.approx(0.75)
    assert sd.mean_accepted_length == pytest.approx(2.5)
    assert sd.acceptance_per_position == pytest.approx([0.75, 0.75])
    run = _run("c=1", s)                                   # 1 request, 10 output tokens/s
    rows = {r[0]: r[1] for r in table_rows([("c=1", run)])}
    assert rows["Spec decode acceptance rate (%)"] == "75.0" and rows["Spec decode mean accepted length"] == "2.50"
    text = " ".join(findings(_bench([run])))
    assert "acceptance rate 75.0%, mean accepted length 2.50" in text and "draft position 1: 75.0%, 2: 75.0%" in text
    # the counters unchanged over a run (speculation disabled by batch size): no rate, a finding that says so
    idle = summarize_series([{"t": 0.0, **after}, {"t": 1.0, **after}])
    assert idle.spec_decode.num_drafts == 0 and idle.spec_decode.acceptance_rate is None
    assert "no drafts" in " ".join(findings(_bench([_run("c=1", idle)])))
    # a server without speculation: no rows
    plain = summarize_series([{"t": 0.0, "running": 1.0}, {"t": 1.0, "running": 0.0}])
    assert not any(r[0].startswith("Spec decode") for r in table_rows([("c=1", _run("c=1", plain))]))


def test_quote_workload_is_seeded_distinct_passages_to_copy(tmp_path):
    a, b = quote_workload(24, 128, seed=5), quote_workload(24, 128, seed=5)
    assert [s.messages for s in a.specs] == [s.messages for s in b.specs]
    assert [s.messages for s in quote_workload(24, seed=6).specs] != [s.messages for s in a.specs]
    texts = [s.messages[0]["content"] for s in a.specs]
    assert len(set(texts)) == 24 and all(s.max_tokens == 128 and s.messages[0]["role"] == "user" for s in a.specs)
    kinds = {s.group for s in a.specs}
    assert {"code-repeat", "text-repeat"} <= kinds and any(k.endswith("edit") for k in kinds) \
        and any(k.endswith("extract") for k in kinds)
    for s in a.specs:
        body = s.messages[0]["content"].split("\n\n", 1)[1]       # the passage after the instruction
        # ~300 tokens (1,078-1,371 characters over 200 passages measured with SmolLM2's tokenizer: 268-382 tokens)
        assert 1000 <= len(body) <= 1500, (s.group, len(body))
        assert 300 <= s.prompt_tokens_est <= 450
        if s.group.startswith("code"):
            assert body.startswith("```python\ndef ") and body.endswith("```")
    # a request's passage depends on (seed, index) only, so a longer run starts with the same requests
    assert [s.messages for s in quote_workload(30, seed=5).specs[:24]] == [s.messages for s in a.specs]
    # as a jsonl dataset, read back the same
    n = write_jsonl(a, tmp_path / "q.jsonl", 30)
    j = jsonl_workload(tmp_path / "q.jsonl")
    assert n == 30 and [s.messages for s in j.specs] == [s.messages for s in a.take(30)]
    assert all(s.max_tokens == 128 for s in j.specs)


def test_write_dataset_writes_the_jsonl_and_sends_nothing(tmp_path, capsys):
    from kvflow.cli import main
    out = tmp_path / "sub" / "quote.jsonl"
    assert main(["bench", "--workload", "quote", "--num-requests", "5", "--output-len", "64", "--seed", "2",
                 "--write-dataset", str(out), "--base-url", "http://127.0.0.1:9/v1"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 5 and all(x["max_tokens"] == 64 and x["messages"][0]["role"] == "user" for x in lines)
    assert lines[0]["messages"] == quote_workload(5, seed=2).specs[0].messages
    assert "wrote 5 requests" in capsys.readouterr().out
    h = tmp_path / "haiku.jsonl"
    assert main(["bench", "--workload", "haiku", "--num-requests", "3", "--write-dataset", str(h)]) == 0
    assert [json.loads(x) for x in h.read_text().splitlines()][2] == {"prompt": "Q2: write a haiku", "max_tokens": 64}


def test_launch_argv_and_variants():
    vary = parse_vary(["max-num-seqs=8,32", "enable-prefix-caching=true,false"])
    vs = variants(vary)
    assert len(vs) == 4 and vs[1] == {"max-num-seqs": "8", "enable-prefix-caching": "false"}
    argv = build_argv("vllm serve m --max-num-seqs 4 --port 9000 --no-enable-prefix-caching --dtype=half", vs[1], 1234)
    assert argv == ["vllm", "serve", "m", "--dtype=half", "--max-num-seqs", "8", "--no-enable-prefix-caching",
                    "--host", "127.0.0.1", "--port", "1234"]
    assert build_argv("kvflow serve m", {}, 5)[1:3] == ["-m", "kvflow.cli"]
    with pytest.raises(ValueError):
        parse_vary(["max-num-seqs"])


def test_sweep_parsing():
    assert parse_sweep("concurrency=1,4,16") == ("concurrency", [1.0, 4.0, 16.0])
    over, vals = parse_sweep("request-rate=1,2.5,inf")
    assert over == "request_rate" and vals[:2] == [1.0, 2.5] and math.isinf(vals[2])
    for bad in ("concurrency=0", "concurrency=1.5", "qps=1", "concurrency="):
        with pytest.raises(ValueError):
            parse_sweep(bad)


def test_a_result_round_trips_through_its_json():
    # records as results.json keeps them (token times to the microsecond), as a result read back has them
    recs = [r.as_saved() for r in [_rec(0, 0.0, 0.1, 1.0, 10, 5), _rec(1, 0.5, 0.3, 1.5, 10, 7),
                                   _rec(2, 0.2, None, 0.01, 0, 9, success=False, kind="http_400")]]
    recs[0].output_text = "ten tokens"
    series = [{"t": 0.0, "running": 2.0, **parse_metrics(SPEC_METRICS % (10, 20, 12, 8, 4))},
              {"t": 1.0, "running": 0.0, **parse_metrics(SPEC_METRICS % (50, 100, 72, 38, 34))}]
    runs = [_run("rate=2.0", summarize_series(series), recs, rate=2.0, series=series, keep_text=True,
                 slo={"ttft": 0.2}, cost=3.6),
            _run("rate=inf", summarize_series([], available=False, error="HTTP 404"), recs[1:2])]
    bench = _bench(runs)
    document = bench.to_json()
    assert document["runs"][1]["load"]["request_rate"] == "inf" and document["meta"]["sweep"]["values"] == [2.0, "inf"]
    assert "output_text" in document["runs"][0]["records"][0] and "output_text" not in document["runs"][1]["records"][0]
    assert list(document["runs"][0]["summary"])[-5:] == ["slo", "goodput", "good_requests", "good_fraction", "cost"]
    text = json.dumps(document, allow_nan=False)              # the file has no infinity
    assert BenchResult.from_json(json.loads(text)) == bench
    assert result_from_json(json.loads(text)) == bench

    ran = VariantResult(name="max-num-seqs=8", settings={"max-num-seqs": "8"}, command="kvflow serve --max-num-seqs 8",
                        log="server-0.log", result=bench, startup_seconds=2.5, exit_code=0)
    broke = VariantResult(name="max-num-seqs=32", settings={"max-num-seqs": "32"},
                          command="kvflow serve --max-num-seqs 32", log="server-1.log",
                          error="RuntimeError: the server exited", exit_code=1)
    experiment = ExperimentResult(meta=ExperimentMeta(common=_meta(base_url=None), launch="kvflow serve",
                                                      varied=["max-num-seqs=8,32"]), variants=[ran, broke])
    none_ran = ExperimentResult(
        meta=ExperimentMeta(common=CommandSettings(command="kvflow bench --launch x", seed=0, model=None, api="chat",
                                                   workload=WorkloadInfo("haiku", {"num_requests": 2}),
                                                   started_at="2026-01-01T00:00:00+00:00",
                                                   finished_at="2026-01-01T00:00:01+00:00"),
                            launch="x", varied=["max-num-seqs=32"]), variants=[broke])
    # the meta's keys: a variant's (base_url in its place) then launch, varied; when none ran, the command line's
    meta_keys = [[*_meta().to_json(), "launch", "varied"],
                 ["command", "seed", "model", "api", "workload", "started_at", "finished_at", "launch", "base_url",
                  "varied"]]
    for exp, keys in zip((experiment, none_ran), meta_keys):
        document = json.loads(json.dumps(exp.to_json(), allow_nan=False))
        assert list(document["meta"]) == keys and document["meta"]["base_url"] is None
        assert ExperimentResult.from_json(document) == exp and result_from_json(document) == exp


DATA = Path(__file__).parent / "data" / "bench"


def _records_tpot(document) -> list:
    """Every record's tpot in a results document, in order."""
    if isinstance(document, dict):
        own = [document["tpot"]] if "token_times" in document else []
        return own + [t for k, v in document.items() for t in _records_tpot(v)]
    if isinstance(document, list):
        return [t for v in document for t in _records_tpot(v)]
    return []


def _without_records_tpot(document):
    if isinstance(document, dict):
        return {k: _without_records_tpot(v) for k, v in document.items()
                if not (k == "tpot" and "token_times" in document)}
    if isinstance(document, list):
        return [_without_records_tpot(v) for v in document]
    return document


@pytest.mark.parametrize("name", ["stub-rate-sweep", "stub-errors-no-metrics", "kvflow-spec-decode",
                                  "experiment-two-variants", "experiment-no-variant-ran"])
def test_saved_results_read_back_render_their_report_and_write_the_same_json(name):
    """Results files kvflow bench wrote (tests/data/bench), each with the Markdown report it wrote from them."""
    text = (DATA / f"{name}.json").read_text()
    result = load_result(DATA / f"{name}.json")
    assert markdown_report(result) == (DATA / f"{name}.md").read_text()
    assert type(result).from_json(result.to_json()) == result
    saved, written = json.loads(text), json.loads(json.dumps(result.to_json(), indent=1, allow_nan=False))
    # the same keys in the same order with the same values, but for each record's tpot: written from the measured
    # token times, recomputed here from the file's (rounded to the microsecond)
    assert json.dumps(_without_records_tpot(written)) == json.dumps(_without_records_tpot(saved))
    assert _records_tpot(written) == pytest.approx(_records_tpot(saved), abs=1e-6)
