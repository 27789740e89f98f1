"""Does a large Batch API job slow interactive traffic down? Interactive TTFT alone against the same load while a
1,000-request batch runs in the background (the goal: p95 TTFT within 1.3x).

    python benchmarks/batch_priority.py [--reps 3] [--batch-lines 1000] [--requests 48] [--concurrency 2]
                                        [--kvflow-args "..."]

One `kvflow serve` on the embedded model (its background compile of the decode steps waited for, as
serve_compare.py does), `--batch-dir` in the output folder. Each repetition measures two phases, their order
alternating between repetitions:
  - alone: `--requests` streamed chat requests (prompts of `--input-len` words, `--max-tokens` tokens each),
    `--concurrency` at a time; the time to the first content token of each;
  - with a batch: a `--batch-lines`-line file of chat requests is uploaded and a batch created with the official
    client (`files.create`, `batches.create`); once its first lines are done the same interactive load runs; then
    the batch is cancelled (how many lines it finished meanwhile is the batch's throughput beside the load).
The table reports the medians over repetitions of each phase's p50 and p95 TTFT and TPOT, and the ratio of p95 TTFT
with the batch to alone.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_compare import wait_for_compiled_steps  # noqa: E402

from kvflow.bench.launcher import LaunchedServer  # noqa: E402
from kvflow.bench.workloads import random_workload  # noqa: E402


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


async def one_stream(client: httpx.AsyncClient, base_url: str, body: dict) -> tuple[float, float | None]:
    """(TTFT, TPOT) of one streamed chat request, in seconds."""
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", base_url + "/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                choices = json.loads(line[5:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    times.append(time.perf_counter())
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return times[0] - t0, tpot


async def interactive(base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    queue = list(enumerate(prompts))
    ttfts, tpots = [], []

    async def worker(client):
        while queue:
            i, prompt = queue.pop(0)
            ttft, tpot = await one_stream(client, base_url, {
                "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True})
            ttfts.append(ttft)
            if tpot is not None:
                tpots.append(tpot)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), trust_env=False) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return {"ttft_p50": pct(ttfts, 0.5), "ttft_p95": pct(ttfts, 0.95), "tpot_p50": pct(tpots, 0.5),
            "tpot_p95": pct(tpots, 0.95), "n": len(ttfts)}


def batch_file(lines: int, model: str, max_tokens: int) -> bytes:
    out = io.StringIO()
    for i in range(lines):
        out.write(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                              "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
                                       "messages": [{"role": "user",
                                                     "content": f"Document {i}: summarise the history of bridges "
                                                                f"in {20 + i % 50} sentences."}]}}) + "\n")
    return out.getvalue().encode()


def with_batch(server: LaunchedServer, model: str, prompts: list[str], args) -> dict:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=600)
    f = client.files.create(file=("batch.jsonl", batch_file(args.batch_lines, model, args.batch_max_tokens)),
                            purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 300
    while True:                                   # running at full width before the interactive load starts
        b = client.batches.retrieve(batch.id)
        done = b.request_counts.completed + b.request_counts.failed if b.request_counts else 0
        if b.status == "in_progress" and done >= args.batch_warmup_lines:
            break
        if b.status in ("failed", "cancelled", "expired", "completed") or time.monotonic() > deadline:
            raise RuntimeError(f"the batch did not get going: {b.status} {b.errors}")
        time.sleep(0.2)
    t0, done0 = time.perf_counter(), done
    r = asyncio.run(interactive(server.base_url, model, prompts, args.concurrency, args.max_tokens))
    elapsed = time.perf_counter() - t0
    b = client.batches.retrieve(batch.id)
    r["batch_lines_per_s"] = (b.request_counts.completed + b.request_counts.failed - done0) / elapsed
    if b.status != "in_progress":
        print(f"warning: the batch ended ({b.status}) before the interactive load did: raise --batch-lines",
              flush=True)
    else:
        client.batches.cancel(batch.id)
    while client.batches.retrieve(batch.id).status not in ("cancelled", "completed", "failed"):
        time.sleep(0.2)
    client.files.delete(f.id)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch-lines", type=int, default=1000)
    ap.add_argument("--batch-max-tokens", type=int, default=64)
    ap.add_argument("--batch-warmup-lines", type=int, default=4, help="lines done before the load starts")
    ap.add_argument("--requests", type=int, default=48, help="interactive requests per phase (p95 of 48: not decided by the first two alone)")
    ap.add_argument("--concurrency", type=int, default=2, help="interactive requests at once")
    ap.add_argument("--input-len", type=int, default=200, help="interactive prompt length (words)")
    ap.add_argument("--max-tokens", type=int, default=16, help="interactive output tokens")
    ap.add_argument("--kvflow-args", default="", help="more `kvflow serve` flags")
    ap.add_argument("--output-dir", default=f"results/batch-priority-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()
    out = Path(args.output_dir)
    prompts = [s.prompt for s in random_workload(args.requests, input_len=args.input_len, output_len=1,
                                                 seed=11).specs]
    launch = f"kvflow serve --batch-dir {out / 'batches'} {args.kvflow_args}"
    phases: dict[str, list[dict]] = {"alone": [], "with batch": []}
    with LaunchedServer(launch, {}, out / "kvflow.log") as server:
        wait_for_compiled_steps(server)
        model = httpx.get(server.base_url + "/models", trust_env=False).json()["data"][0]["id"]
        # warm-up: every prompt once (the first pass over new prompt lengths was 5x slower here: per-shape kernel
        # set-up in the eager prefill steps), so each phase measures the steady state
        asyncio.run(interactive(server.base_url, model, prompts, args.concurrency, args.max_tokens))
        for rep in range(args.reps):
            order = ["alone", "with batch"] if rep % 2 == 0 else ["with batch", "alone"]
            for phase in order:
                r = (asyncio.run(interactive(server.base_url, model, prompts, args.concurrency, args.max_tokens))
                     if phase == "alone" else with_batch(server, model, prompts, args))
                phases[phase].append(r)
                print(f"rep {rep} {phase}: {json.dumps({k: round(v, 4) for k, v in r.items()})}", flush=True)
    (out / "batch_priority.json").write_text(json.dumps({"args": vars(args), "phases": phases}, indent=1))

    def med(phase: str, key: str) -> float:
        return statistics.median(r[key] for r in phases[phase])

    print(f"\n{args.requests} interactive chat requests ({args.input_len}-word prompts, {args.max_tokens} tokens) at "
          f"concurrency {args.concurrency}; batch: {args.batch_lines} chat lines of {args.batch_max_tokens} tokens; "
          f"medians of {args.reps} reps")
    print(f"| phase | TTFT p50 | TTFT p95 | TPOT p50 | TPOT p95 | batch lines/s |\n|---|---|---|---|---|---|")
    for phase in phases:
        lines = f"{med(phase, 'batch_lines_per_s'):.2f}" if phase == "with batch" else "-"
        print(f"| {phase} | {med(phase, 'ttft_p50') * 1e3:.0f} ms | {med(phase, 'ttft_p95') * 1e3:.0f} ms | "
              f"{med(phase, 'tpot_p50') * 1e3:.1f} ms | {med(phase, 'tpot_p95') * 1e3:.1f} ms | {lines} |")
    ratio = med("with batch", "ttft_p95") / med("alone", "ttft_p95")
    print(f"\np95 TTFT with the batch / alone: {ratio:.2f}x (goal <= 1.3x)")


if __name__ == "__main__":
    main()
