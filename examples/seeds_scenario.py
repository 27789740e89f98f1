"""The seeds' scenario, written as a user would against `kvflow serve`:

    kvflow serve                      # in one terminal (embedded SmolLM2-135M-Instruct)
    python examples/seeds_scenario.py --base-url http://localhost:8000/v1

1. a streamed chat completion ("Explain HNSW in 3 sentences.", max_tokens 200), printed as it arrives;
2. 32 concurrent AsyncOpenAI chat.completions.create calls ("Q{i}: write a haiku", max_tokens 64),
   one line each with latency and token counts.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

from openai import AsyncOpenAI, OpenAI


def streamed(client: OpenAI, model: str) -> None:
    t0 = time.perf_counter()
    first = None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Explain HNSW in 3 sentences."}],
        max_tokens=200, stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            print(chunk.choices[0].delta.content, end="", flush=True)
    total = time.perf_counter() - t0
    print()
    if usage is not None:
        print(f"[streamed: TTFT {first or 0:.3f}s, total {total:.2f}s, prompt {usage.prompt_tokens} tokens, "
              f"completion {usage.completion_tokens} tokens, {usage.completion_tokens / total:.1f} tokens/s]")


async def one(client: AsyncOpenAI, model: str, i: int) -> tuple[int, float, int, int]:
    t0 = time.perf_counter()
    r = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Q{i}: write a haiku"}], max_tokens=64)
    return i, time.perf_counter() - t0, r.usage.prompt_tokens, r.usage.completion_tokens


async def concurrent(base_url: str, api_key: str, model: str, n: int) -> None:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    t0 = time.perf_counter()
    try:
        tasks = [asyncio.create_task(one(client, model, i)) for i in range(n)]
        total_tokens = 0
        for task in asyncio.as_completed(tasks):
            i, latency, prompt, completion = await task
            total_tokens += completion
            print(f"Q{i:<2} latency {latency:6.2f}s  prompt {prompt:3d} tokens  completion {completion:3d} tokens")
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    print(f"[{n} concurrent requests in {wall:.2f}s: {total_tokens} completion tokens, "
          f"{total_tokens / wall:.1f} tokens/s overall]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://localhost:8000/v1")
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--model", default=None, help="default: the first model the server lists")
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    print(f"model: {model}\n")
    streamed(client, model)
    print()
    asyncio.run(concurrent(args.base_url, args.api_key, model, args.concurrency))
    return 0


if __name__ == "__main__":
    sys.exit(main())
