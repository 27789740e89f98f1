"""`kvflow bench` against the real kvflow server (`kvflow serve` in a subprocess, tiny random-weight model):
reports are valid, a prompt over the context limit counts as an http_400 error, and the optimization experiment
(--launch ... --vary) writes one comparison report."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from kvflow.bench.launcher import LaunchedServer

SERVE = "kvflow serve {model} --dtype float32 --max-model-len 256 --kv-cache-memory 64MiB"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_hf_model
    return make_tiny_hf_model(tmp_path_factory.mktemp("bench-tiny") / "tiny", family="llama", seed=0)


@pytest.fixture(scope="module")
def kvflow_server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("bench-server") / "server.log"
    server = LaunchedServer(SERVE.format(model=tiny_model), {}, log)
    server.start(timeout=180)
    yield server
    assert server.stop() == 0, server.log_tail()


def bench(*argv: str) -> int:
    from kvflow.cli import main
    return main(["bench", "--no-progress", *argv])


@pytest.mark.slow
def test_bench_against_kvflow_server(kvflow_server, tmp_path):
    assert httpx.get(kvflow_server.root_url + "/health", trust_env=False).status_code == 200
    lines = [{"messages": [{"role": "user", "content": f"Q{i}: write a haiku"}], "max_tokens": 12}
             for i in range(15)]
    lines.append({"messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 8})   # > max-model-len
    data = tmp_path / "w.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "run"
    rc = bench("--base-url", kvflow_server.base_url, "--workload", "jsonl", "--dataset", str(data),
               "--concurrency", "8", "--ignore-eos", "--slo", "ttft=10s", "--metrics-interval", "0.1",
               "--output-dir", str(out))
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    meta, run = result["meta"], result["runs"][0]
    assert meta["server_version"]["version"] and meta["model"] in meta["server_models"]
    s = run["summary"]
    assert (s["completed"], s["failed"]) == (15, 1) and s["errors_by_kind"] == {"http_400": 1}
    assert s["total_output_tokens"] == 15 * 12                  # ignore_eos honoured, usage reported
    assert all(r["usage_reported"] and len(r["token_times"]) == 12 for r in run["records"] if r["success"])
    assert s["ttft_ms"]["p95"] > 0 and s["tpot_ms"]["p50"] > 0 and s["itl_ms"]["count"] == 15 * 11
    assert run["server"]["available"] and "running_max" in run["server"] and "kv_cache_usage_max" in run["server"]
    assert run["server"]["engine_busy_source"] == "kvflow:step_duration_seconds"
    assert "Output token throughput" in (out / "report.md").read_text()
    assert (out / "report.html").read_text().count("data:image/png;base64,") >= 2

    out2 = tmp_path / "completions"
    assert bench("--base-url", kvflow_server.base_url, "--api", "completions", "--workload", "random",
                 "--input-len", "20", "--output-len", "8", "--num-requests", "8", "--request-rate", "50",
                 "--ignore-eos", "--output-dir", str(out2)) == 0
    s2 = json.loads((out2 / "results.json").read_text())["runs"][0]["summary"]
    assert s2["completed"] == 8 and s2["total_output_tokens"] == 64


@pytest.mark.slow
def test_optimization_experiment_static_vs_continuous(tiny_model, tmp_path):
    out = tmp_path / "exp"
    rc = bench("--launch", SERVE.format(model=tiny_model), "--vary", "scheduling-policy=static,continuous",
               "--workload", "haiku", "--num-requests", "16", "--concurrency", "8", "--output-len", "16",
               "--ignore-eos", "--cost-per-hour", "1.0", "--metrics-interval", "0.1", "--output-dir", str(out))
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    assert result["kind"] == "experiment"
    names = [v["name"] for v in result["variants"]]
    assert names == ["scheduling-policy=static", "scheduling-policy=continuous"]
    for v in result["variants"]:
        assert v["error"] is None and v["exit_code"] == 0, Path(v["log"]).read_text()[-2000:]
        assert "--scheduling-policy" in v["command"] and "--host 127.0.0.1" in v["command"]
        assert v["result"]["runs"][0]["summary"]["completed"] == 16
    md = (out / "report.md").read_text()
    assert "## Findings" in md and "Highest throughput" in md and "Lowest p95 time to first token" in md
    assert "Cost at $1/hour" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 3


@pytest.mark.slow
def test_bench_reports_speculative_decoding_from_the_servers_counters(tiny_model, tmp_path):
    """The quote workload against the real server with n-gram speculation: the report's acceptance rate and mean
    accepted length are the server's own spec_decode counters (a fresh server, no warmup: the run's deltas are
    the totals /metrics shows afterwards)."""
    from kvflow.config import EngineConfig
    from kvflow.server.testing import ServerThread

    config = EngineConfig(model=str(tiny_model), dtype="float32", max_model_len=512, kv_cache_memory="64MiB",
                          enforce_eager=True, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    out = tmp_path / "spec"
    with ServerThread(config) as server:
        rc = bench("--base-url", server.base_url, "--workload", "quote", "--num-requests", "4", "--concurrency", "2",
                   "--output-len", "24", "--ignore-eos", "--warmup", "0", "--metrics-interval", "0.1",
                   "--output-dir", str(out))
        text = httpx.get(server.url + "/metrics", trust_env=False).text
    assert rc == 0
    totals = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:spec_decode") and "per_pos" not in line}
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["summary"]["completed"] == 4 and run["summary"]["total_output_tokens"] == 4 * 24
    assert run["summary"]["mean_input_tokens"] > 300                   # ~300-token passages + instruction
    srv = run["server"]
    drafts, tokens = totals["vllm:spec_decode_num_drafts_total"], totals["vllm:spec_decode_num_draft_tokens_total"]
    accepted = totals["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0, totals
    assert (srv["spec_decode_num_drafts"], srv["spec_decode_num_draft_tokens"],
            srv["spec_decode_num_accepted_tokens"]) == (drafts, tokens, accepted)
    assert srv["spec_decode_acceptance_rate"] == pytest.approx(accepted / tokens)
    assert srv["spec_decode_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)
    per_pos = srv["spec_decode_acceptance_per_position"]
    assert len(per_pos) == 3 and sum(per_pos) * drafts == pytest.approx(accepted)
    md = (out / "report.md").read_text()
    assert "| Spec decode acceptance rate (%) |" in md and "| Spec decode mean accepted length |" in md
    assert "Speculative decoding in `" in md
