"""Prefix caching on versus off: TTFT with a shared ~500-token system prompt and 32 different questions,
through the real server and the official client, both variants in one run.

    python benchmarks/prefix_cache.py [--reps 3] [--concurrency 8] [--model PATH]

Each rep starts a server per variant (cold cache), sends one warm-up request with the system prompt,
then the 32 questions as streamed chat completions, `--concurrency` at a time. Prints TTFT p50 / p95
(median over reps), prompt tokens computed by the engine, and the ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import openai

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread

SYSTEM = "You are a meticulous assistant for a logistics company. " + " ".join(
    f"Rule {i}: always check shipment {i} against manifest {i * 7} before answering." for i in range(26))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


async def run_questions(base_url: str, concurrency: int) -> list[float]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x")
    model = (await client.models.list()).data[0].id
    sem = asyncio.Semaphore(concurrency)

    async def ask(i: int) -> float:
        async with sem:
            t0 = time.perf_counter()
            stream = await client.chat.completions.create(
                model=model, stream=True, max_tokens=16, temperature=0,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: where is box {i}?"}])
            ttft = None
            async for chunk in stream:
                if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft = time.perf_counter() - t0
            return ttft if ttft is not None else time.perf_counter() - t0

    await ask(-1)                       # warm-up: computes (and, with caching, caches) the system prompt
    ttfts = await asyncio.gather(*(ask(i) for i in range(32)))
    await client.close()
    return list(ttfts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    rows = {True: [], False: []}
    for _ in range(args.reps):
        for prefix in (True, False):               # alternate variants: the machine is noisy
            config = EngineConfig(model=args.model, dtype=args.dtype, max_model_len=2048, kv_cache_memory="1GiB",
                                  enable_prefix_caching=prefix)
            with ServerThread(config) as server:
                before = server.core("counters")["num_prompt_tokens_computed"]
                ttfts = asyncio.run(run_questions(server.base_url, args.concurrency))
                computed = server.core("counters")["num_prompt_tokens_computed"] - before
            rows[prefix].append((pct(ttfts, 0.5), pct(ttfts, 0.95), computed))
    print(f"32 questions with a shared system prompt, concurrency {args.concurrency}, median of {args.reps} reps")
    print(f"{'prefix caching':<16}{'TTFT p50 (s)':>14}{'TTFT p95 (s)':>14}{'prompt tokens computed':>24}")
    med = {}
    for prefix, rs in rows.items():
        med[prefix] = [statistics.median(r[i] for r in rs) for i in range(3)]
        print(f"{'on' if prefix else 'off':<16}{med[prefix][0]:>14.3f}{med[prefix][1]:>14.3f}{med[prefix][2]:>24.0f}")
    print(f"TTFT p50 off/on: {med[False][0] / med[True][0]:.2f}x, p95 off/on: {med[False][1] / med[True][1]:.2f}x")


if __name__ == "__main__":
    main()
