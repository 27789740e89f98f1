"""`kvflow bench` against a tiny OpenAI-compatible stub server that answers instantly (run as its own process on a
free loopback port): valid JSON / Markdown / HTML, the client's own overhead ceiling, and error accounting.

The stub's behaviour is chosen by the prompt: ERR400 / ERR500 answer that status, BREAK cuts the stream,
STREAMERR sends an error event, SLEEP never answers in time, MULTI sends 3 tokens per chunk.
Run the stub alone: python tests/test_bench_stub.py PORT [--no-metrics]
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request   # module level: FastAPI resolves the string annotations here
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvflow.server.testing import free_port

REPO = Path(__file__).resolve().parents[1]


# ---- the stub server ---------------------------------------------------------------------------------------------

def make_app(with_metrics: bool = True):
    app = FastAPI()
    state = {"running": 0, "requests": 0, "queries": 0, "hits": 0, "tokens": 0}

    def text_of(body: dict) -> str:
        if "messages" in body:
            return " ".join(str(m.get("content", "")) for m in body["messages"])
        return str(body.get("prompt", ""))

    async def generate(body: dict, chat: bool):
        text = text_of(body)
        n = int(body.get("max_tokens") or 16)
        per_chunk = 3 if "MULTI" in text else 1
        usage_on = (body.get("stream_options") or {}).get("include_usage")
        obj = "chat.completion.chunk" if chat else "text_completion"
        state["running"] += 1
        state["requests"] += 1
        state["queries"] += len(text.split())
        state["hits"] += len(text.split()) // 2
        try:
            sent = 0
            while sent < n:
                k = min(per_chunk, n - sent)
                piece = "tok " * k
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                yield f"data: {json.dumps({'object': obj, 'choices': [choice]})}\n\n"
                sent += k
                if "BREAK" in text and sent >= 2:
                    raise RuntimeError("stub: cut the stream")
                if "STREAMERR" in text and sent >= 1:
                    yield f"data: {json.dumps({'error': {'message': 'engine failed', 'code': 500}})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if sent % 16 == 0:
                    await asyncio.sleep(0)
            state["tokens"] += n
            end = {"index": 0, "delta": {}, "finish_reason": "length"} if chat else \
                {"index": 0, "text": "", "finish_reason": "length"}
            yield f"data: {json.dumps({'object': obj, 'choices': [end]})}\n\n"
            if usage_on:
                usage = {"prompt_tokens": len(text.split()), "completion_tokens": n,
                         "total_tokens": len(text.split()) + n}
                yield f"data: {json.dumps({'object': obj, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            state["running"] -= 1

    async def handle(request: Request, chat: bool):
        body = await request.json()
        text = text_of(body)
        for code in (400, 500):
            if f"ERR{code}" in text:
                return JSONResponse({"error": {"message": f"stub error {code}", "type": "BadRequestError",
                                               "code": code}}, status_code=code)
        if "SLEEP" in text:
            await asyncio.sleep(5)
        return StreamingResponse(generate(body, chat), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.get("/version")
    async def version():
        return {"version": "stub-1.0"}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    if with_metrics:
        @app.get("/metrics")
        async def metrics():
            s = state
            return PlainTextResponse(
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="stub-model"}} {s["running"]}\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                'vllm:num_requests_waiting{model_name="stub-model"} 0\n'
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{model_name="stub-model"}} {s["running"] / 100}\n'
                "# TYPE vllm:prefix_cache_queries counter\n"
                f'vllm:prefix_cache_queries_total{{model_name="stub-model"}} {s["queries"]}\n'
                "# TYPE vllm:prefix_cache_hits counter\n"
                f'vllm:prefix_cache_hits_total{{model_name="stub-model"}} {s["hits"]}\n'
                "# TYPE vllm:num_preemptions counter\n"
                'vllm:num_preemptions_total{model_name="stub-model"} 0\n'
                "# TYPE process_resident_memory_bytes gauge\n"
                "process_resident_memory_bytes 1.048576e+08\n")
    return app


class StubServer:
    def __init__(self, with_metrics: bool = True):
        self.port = free_port()
        self.with_metrics = with_metrics
        self.proc = None

    def __enter__(self):
        argv = [sys.executable, __file__, str(self.port)] + ([] if self.with_metrics else ["--no-metrics"])
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1, trust_env=False).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise TimeoutError("the stub server did not start")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"


def bench(*argv: str) -> int:
    from kvflow.cli import main
    return main(["bench", "--no-progress", *argv])


# ---- tests -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stub():
    with StubServer() as s:
        yield s


@pytest.mark.slow
def test_bench_run_writes_valid_reports_and_measures_client_ceiling(stub, tmp_path, capsys):
    out = tmp_path / "run"
    rc = bench("--base-url", stub.base_url, "--workload", "random", "--input-len", "32", "--output-len", "64",
               "--num-requests", "300", "--concurrency", "32", "--slo", "ttft=1s,tpot=100ms",
               "--cost-per-hour", "2.0", "--metrics-interval", "0.1", "--output-dir", str(out))
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads((out / "results.json").read_text())
    assert result["kind"] == "bench"
    meta = result["meta"]
    assert meta["model"] == "stub-model" and meta["server_version"] == {"version": "stub-1.0"}
    assert meta["seed"] == 0 and meta["kvflow_version"]
    assert meta["command"].startswith("kvflow bench") and "--concurrency 32" in meta["command"]
    run = result["runs"][0]
    s = run["summary"]
    assert s["completed"] == 300 and s["failed"] == 0
    assert len(run["records"]) == 300
    rec = run["records"][0]
    assert rec["output_tokens"] == 64 and rec["usage_reported"] and len(rec["token_times"]) == 64
    assert rec["prompt_tokens"] == 32
    assert s["total_output_tokens"] == 300 * 64
    assert s["goodput"] is not None and s["cost"]["per_million_output_tokens"] > 0
    assert run["server"]["available"] and run["server"]["prefix_cache_hit_rate"] == pytest.approx(0.5, abs=0.02)
    assert run["server"]["resident_memory_bytes_max"] == 104857600
    md = (out / "report.md").read_text()
    assert "Output token throughput" in md and "## Findings" in md
    html = (out / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("data:image/png;base64,") >= 2
    assert "http" not in html.replace("http://127.0.0.1", "")   # self-contained: no external resources

    rps, tps = s["request_throughput"], s["output_throughput"]
    cpu = run["client"]["cpu_fraction"]
    print(f"\nclient overhead ceiling (stub answers instantly, 64 tokens/request, 1 token/chunk, concurrency 32): "
          f"{rps:.0f} requests/s, {tps:.0f} output tokens/s, client CPU {cpu:.0%} of one core")
    # far more than a CPU engine produces here (a few hundred tokens/s)
    assert tps > 1000


@pytest.mark.slow
def test_bench_counts_errors_by_kind_and_finishes(tmp_path):
    lines = [{"prompt": "hello there", "max_tokens": 8},
             {"prompt": "ERR400 a prompt over the context limit"},
             {"prompt": "ERR500 boom"},
             {"prompt": "BREAK the stream", "max_tokens": 8},
             {"prompt": "STREAMERR please", "max_tokens": 8},
             {"prompt": "SLEEP forever"},
             {"messages": [{"role": "user", "content": "MULTI chunks"}], "max_tokens": 9}]
    data = tmp_path / "w.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "err"
    with StubServer(with_metrics=False) as stub:
        rc = bench("--base-url", stub.base_url, "--api", "completions", "--workload", "jsonl", "--dataset",
                   str(data), "--concurrency", "4", "--timeout", "2", "--warmup", "0", "--output-dir", str(out))
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    s = result["runs"][0]["summary"]
    assert s["completed"] == 2 and s["failed"] == 5
    assert s["errors_by_kind"] == {"broken_stream": 1, "http_400": 1, "http_500": 1, "stream_error": 1,
                                   "timeout": 1}
    recs = {r["index"]: r for r in result["runs"][0]["records"]}
    assert "stub error 400" in recs[1]["error"]
    multi = recs[6]
    assert multi["success"] and multi["num_chunks"] == 3 and multi["output_tokens"] == 9
    assert len(multi["token_times"]) == 9
    assert result["runs"][0]["server"]["available"] is False
    md = (out / "report.md").read_text()
    assert "http_400: 1" in md and "no server metrics" in md
    assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")


@pytest.mark.slow
def test_sweep_and_compare(stub, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert bench("--base-url", stub.base_url, "--workload", "haiku", "--num-requests", "16", "--output-len", "8",
                 "--sweep", "concurrency=1,4", "--output-dir", str(a)) == 0
    assert bench("--base-url", stub.base_url, "--workload", "shared-prefix", "--num-prefixes", "2",
                 "--questions-per-prefix", "4", "--prefix-len", "20", "--question-len", "5", "--output-len", "8",
                 "--request-rate", "200", "--output-dir", str(b)) == 0
    ra = json.loads((a / "results.json").read_text())
    assert [r["label"] for r in ra["runs"]] == ["concurrency=1", "concurrency=4"]
    assert ra["meta"]["sweep"] == {"over": "concurrency", "values": [1.0, 4.0]}
    assert (a / "report.html").read_text().count("data:image/png;base64,") >= 3   # sweep, CDFs, timeline
    rb = json.loads((b / "results.json").read_text())
    assert rb["runs"][0]["summary"]["completed"] == 8
    capsys.readouterr()
    assert bench("compare", str(a / "results.json"), str(b), "-o", str(tmp_path / "cmp.md")) == 0
    text = capsys.readouterr().out
    assert "÷ a: concurrency=1" in text and "Output token throughput" in text
    assert (tmp_path / "cmp.md").read_text() == text[:-1]   # print() added one newline


@pytest.mark.slow
def test_duration_with_poisson_arrivals(stub, tmp_path):
    out = tmp_path / "dur"
    assert bench("--base-url", stub.base_url, "--workload", "haiku", "--output-len", "4", "--request-rate", "40",
                 "--duration", "1", "--warmup", "0", "--seed", "7", "--output-dir", str(out)) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    sends = [r["send_time"] for r in run["records"]]
    assert 15 <= len(sends) <= 70 and max(sends) < 1.0       # ~40 arrivals in 1 s, none after the deadline
    assert run["summary"]["failed"] == 0 and run["load"]["request_rate"] == 40.0


def test_unreachable_server_is_a_clean_error(tmp_path, capsys):
    rc = bench("--base-url", f"http://127.0.0.1:{free_port()}/v1", "--output-dir", str(tmp_path / "x"))
    assert rc == 1
    assert "cannot reach the server" in capsys.readouterr().err


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(make_app(with_metrics="--no-metrics" not in sys.argv), host="127.0.0.1", port=int(sys.argv[1]),
                log_level="warning", access_log=False)
