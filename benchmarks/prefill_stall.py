"""Do streaming requests stall while a long prompt is prefilled? Inter-token latency with and without it.

    python benchmarks/prefill_stall.py [--budgets 1024 128] [--streams 4] [--long-tokens 2000] [--window 8]

For each step token budget (`--max-num-batched-tokens`), one fresh `kvflow serve` on the embedded model:
`--streams` streamed completions run (ignore_eos). Once all of them stream, their inter-token gaps are
recorded for `--window` seconds (the baseline); then one prompt of `--long-tokens` tokens arrives, and the gaps
that end while it is being prefilled (until its first token comes back) are the stall window. The goal: the
stall window's p99 within 3x of the baseline's p99, which chunked prefill under the token budget provides
when the budget is small enough that a step with a prefill chunk is not much longer than a decode step.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from kvflow.bench.launcher import LaunchedServer
from kvflow.bench.workloads import random_workload


def p99(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(0.99 * (len(v) - 1))))]


async def stream(client: httpx.AsyncClient, url: str, body: dict, arrivals: list[float]) -> None:
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                choice = json.loads(line[5:])["choices"]
                if choice and choice[0].get("text"):
                    arrivals.append(time.perf_counter())


async def measure(base_url: str, streams: int, long_tokens: int, window: float, max_tokens: int) -> dict:
    url = base_url + "/completions"
    long_prompt = random_workload(1, input_len=long_tokens, output_len=1, seed=7).specs[0].prompt
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), trust_env=False) as client:
        model = (await client.get(base_url + "/models")).json()["data"][0]["id"]
        await client.post(url, json={"model": model, "prompt": "Hello", "max_tokens": 4})     # warm-up
        arrivals = [[] for _ in range(streams)]
        tasks = [asyncio.create_task(stream(client, url, {
            "model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}, arrivals[i])) for i in range(streams)]
        while min(len(a) for a in arrivals) < 3:
            await asyncio.sleep(0.05)
        t_a = time.perf_counter()
        await asyncio.sleep(window)
        t_b = time.perf_counter()
        r = await client.post(url, json={"model": model, "prompt": long_prompt, "max_tokens": 1,
                                         "temperature": 0})
        t_c = time.perf_counter()
        r.raise_for_status()
        long_prompt_tokens = r.json()["usage"]["prompt_tokens"]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def gaps(lo: float, hi: float) -> list[float]:
        return [b - a for arr in arrivals for a, b in zip(arr, arr[1:]) if lo < b <= hi]

    base, stall = gaps(t_a, t_b), gaps(t_b, t_c)
    if not base or not stall:
        raise RuntimeError("a window has no inter-token gaps: raise --max-tokens or --window")
    return {"baseline_p99_ms": p99(base) * 1e3, "baseline_median_ms": statistics.median(base) * 1e3,
            "stall_p99_ms": p99(stall) * 1e3, "stall_max_ms": max(stall) * 1e3,
            "stall_ratio_p99": p99(stall) / p99(base), "prefill_seconds": t_c - t_b,
            "long_prompt_tokens": long_prompt_tokens, "gaps": [len(base), len(stall)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=int, nargs="+", default=[1024, 128], help="--max-num-batched-tokens values")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--window", type=float, default=8.0, help="seconds of baseline")
    ap.add_argument("--max-tokens", type=int, default=1000, help="per stream; they are cancelled at the end")
    ap.add_argument("--kvflow-args", default="")
    ap.add_argument("--output-dir", default=f"results/prefill-stall-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()
    out = Path(args.output_dir)
    rows = {}
    for budget in args.budgets:
        launch = f"kvflow serve --max-num-batched-tokens {budget} {args.kvflow_args}"
        with LaunchedServer(launch, {}, out / f"kvflow-budget{budget}.log") as server:
            rows[budget] = asyncio.run(measure(server.base_url, args.streams, args.long_tokens, args.window,
                                               args.max_tokens))
        print(f"budget {budget}: {rows[budget]}", flush=True)
    (out / "prefill_stall.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{args.streams} streams; one {args.long_tokens}-word prompt arrives after {args.window:.0f} s")
    print(f"{'budget':>7} {'ITL p99 alone':>14} {'ITL p99 during prefill':>23} {'ratio':>6} {'max gap':>8} "
          f"{'prefill s':>9}")
    for budget, r in rows.items():
        print(f"{budget:>7} {r['baseline_p99_ms']:>12.0f}ms {r['stall_p99_ms']:>21.0f}ms {r['stall_ratio_p99']:>5.2f}x "
              f"{r['stall_max_ms']:>6.0f}ms {r['prefill_seconds']:>9.1f}")
    print("goal: ratio <= 3")


if __name__ == "__main__":
    main()
