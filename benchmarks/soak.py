"""Soak: mixed load against `kvflow serve` for a chosen time, watching memory, errors and the token counters.

    python benchmarks/soak.py --duration 1800 [--concurrency 16] [--kvflow-args "--max-num-seqs 32"]

Each of --concurrency clients loops until the time is up: a streamed or non-streamed chat completion with a
prompt of 10-500 words and max_tokens 16-128; ~10% disconnect after a few chunks; ~5% send an invalid request
(a deliberate 400). Every 10 s the server's RSS (/proc) and /metrics are sampled. At the end it reports RSS at
start and end, RSS growth after the first 5 minutes (and the slope), every error by kind, and checks that the
server's token counters equal the sum over its request log (one line per finished request, aborted ones
included) and that every completed request's `usage` equals its request-log line. Results: soak.json.
Not a test: run it alone on an idle machine.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import shlex
import statistics
import time
from pathlib import Path

import httpx

from kvflow.bench.launcher import LaunchedServer

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "number group problem fact river cloud engine token batch cache").split()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def client_loop(k: int, http: httpx.AsyncClient, model: str, deadline: float, stats: dict) -> None:
    rng = random.Random(k)
    while time.monotonic() < deadline:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 500)))
        body = {"model": model, "messages": [{"role": "user", "content": f"Summarize: {words}"}],
                "max_tokens": rng.randint(16, 128), "temperature": rng.choice([0.0, 0.8])}
        kind = rng.random()
        if kind < 0.05:
            body["temperature"] = -1                      # deliberate 400
        stream = rng.random() < 0.5
        disconnect = kind > 0.9
        if stream or disconnect:
            body["stream"], body["stream_options"] = True, {"include_usage": True}
        try:
            if not body.get("stream"):
                r = await http.post("/v1/chat/completions", json=body)
                if r.status_code == 200:
                    stats["completed"].append((r.json()["id"], r.json()["usage"]))
                else:
                    stats["errors"][f"http {r.status_code}" + (" (deliberate)" if body["temperature"] == -1
                                                               else "")] += 1
                continue
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    stats["errors"][f"http {r.status_code}" + (" (deliberate)" if body["temperature"] == -1
                                                               else "")] += 1
                    continue
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            stats["errors"]["error event"] += 1
                        elif chunk.get("usage"):
                            stats["completed"].append((chunk["id"], chunk["usage"]))
                    chunks += line.startswith("data: ")
                    if disconnect and chunks >= 3:
                        stats["disconnected"] += 1
                        break
                else:
                    stats["streamed"] += 1
        except httpx.HTTPError as e:
            stats["errors"][f"transport {type(e).__name__}"] += 1


async def sampler(server: LaunchedServer, deadline: float, samples: list) -> None:
    async with httpx.AsyncClient(base_url=server.root_url, timeout=30) as http:
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            text = (await http.get("/metrics")).text
            samples.append({"t": time.monotonic() - t0, "rss": rss_bytes(server.proc.pid),
                            "running": metric(text, "vllm:num_requests_running"),
                            "kv": metric(text, "vllm:kv_cache_usage_perc")})
            await asyncio.sleep(10)


async def soak(server: LaunchedServer, args) -> dict:
    deadline = time.monotonic() + args.duration
    stats = {"completed": [], "errors": collections.Counter(), "disconnected": 0, "streamed": 0}
    samples: list = []
    async with httpx.AsyncClient(base_url=server.root_url, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        await asyncio.gather(sampler(server, deadline, samples),
                             *(client_loop(k, http, model, deadline, stats) for k in range(args.concurrency)))
    return {"stats": stats, "samples": samples}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kvflow-args", default="", help="extra `kvflow serve` flags")
    p.add_argument("--output-dir", default="results/soak")
    args = p.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    request_log = out / "requests.jsonl"
    request_log.unlink(missing_ok=True)
    launch = f"kvflow serve --request-log {request_log} --log-stats-interval 60 {args.kvflow_args}"
    with LaunchedServer(launch, {}, out / "server.log") as server:
        result = asyncio.run(soak(server, args))
        time.sleep(2)                                          # let the last aborts reach the log
        metrics_text = httpx.get(server.root_url + "/metrics").text
    stats, samples = result["stats"], result["samples"]
    log = {}
    for line in request_log.read_text().splitlines():
        entry = json.loads(line)
        log[entry["id"]] = entry
    counters = {"prompt": metric(metrics_text, "vllm:prompt_tokens_total"),
                "generation": metric(metrics_text, "vllm:generation_tokens_total")}
    logged = {"prompt": sum(e["prompt_tokens"] for e in log.values()),
              "generation": sum(e["completion_tokens"] for e in log.values())}
    usage_mismatch = [rid for rid, u in stats["completed"]
                      if rid not in log or log[rid]["completion_tokens"] != u["completion_tokens"]
                      or log[rid]["prompt_tokens"] != u["prompt_tokens"]]
    after5 = [s for s in samples if s["t"] >= 300] or samples
    rss0, rss1 = after5[0]["rss"], samples[-1]["rss"]
    slope = statistics.linear_regression([s["t"] for s in after5], [s["rss"] for s in after5]).slope \
        if len(after5) > 1 else 0.0
    report = {
        "duration_s": args.duration, "concurrency": args.concurrency, "command": shlex.join(server.argv),
        "requests_completed": len(stats["completed"]), "of_them_streamed": stats["streamed"],
        "disconnected": stats["disconnected"], "errors": dict(stats["errors"]),
        "rss_start_mib": samples[0]["rss"] / 2**20, "rss_end_mib": rss1 / 2**20,
        "rss_after_5min_mib": rss0 / 2**20, "rss_growth_after_5min_pct": 100.0 * (rss1 - rss0) / rss0,
        "rss_slope_mib_per_hour": slope * 3600 / 2**20,
        "counters": counters, "request_log_sums": logged, "counters_match_request_log": counters == logged,
        "usage_mismatches": len(usage_mismatch), "final_kv_usage": samples[-1]["kv"],
    }
    (out / "soak.json").write_text(json.dumps({"report": report, "samples": samples}, indent=1))
    for k, v in report.items():
        print(f"{k:>32}: {v:.1f}" if isinstance(v, float) else f"{k:>32}: {v}")


if __name__ == "__main__":
    main()
