"""What structured outputs cost through the server: throughput with a JSON schema on every request against the
same load without one, and the first-request compile cost (TTFT of a new schema against a cached one).

    python benchmarks/structured_output.py [--concurrency 32] [--requests 64] [--max-tokens 64] [--reps 2]

The server (embedded SmolLM2 unless --model, the server's default settings) runs in this process. Both runs send
the same chat prompt with the same max_tokens; the schema (a list of at least 40 objects) cannot be complete
within max_tokens and the unconstrained run ignores EOS, so every request of both runs writes exactly
max_tokens tokens and the ratio of output tokens per second is the ratio of the work done per second. The runs
alternate (--reps pairs; medians reported). Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import openai

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "tags": {"type": "array", "items": {"enum": ["new", "used", "rare"]},
                                                  "maxItems": 2}},
        "required": ["name", "qty", "tags"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 40}},
          "required": ["items"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "List the items in the shop as JSON: name, quantity and tags."}]


def big_schema(tag: str, n: int = 30) -> dict:
    """A schema nobody compiled yet (property names carry the tag): a first-request compile."""
    return {"type": "object", "properties": {f"{tag}_{i}": ITEM if i % 3 == 0 else {"type": "string", "maxLength": 8}
                                             for i in range(n)}, "additionalProperties": False}


async def load(client: openai.AsyncOpenAI, requests: int, concurrency: int, max_tokens: int, schema: dict | None):
    gate = asyncio.Semaphore(concurrency)
    extra = {"guided_json": schema} if schema else {"ignore_eos": True}

    async def one(i: int) -> int:
        async with gate:
            r = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=max_tokens,
                                                     temperature=0.7, seed=i, extra_body=extra)
            assert r.choices[0].finish_reason == "length", r.choices[0]
            return r.usage.completion_tokens

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
    return tokens / (time.perf_counter() - t0)


async def ttft(client: openai.AsyncOpenAI, schema: dict | None) -> float:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, stream=True,
                                                  extra_body={"guided_json": schema} if schema else None)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
            break
    async for _ in stream:
        pass
    return first


async def main(args) -> dict:
    config = EngineConfig(model=args.model, served_model_name="m", max_num_seqs=max(64, args.concurrency))
    with ServerThread(config) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=3600)
        try:
            # first constrained request of the server: it also builds the grammar compiler (tokenizer tables)
            first_ever = await ttft(client, big_schema("boot"))
            plain, new, cached = [], [], []
            for k in range(args.compile_reps):
                plain.append(await ttft(client, None))
                new.append(await ttft(client, big_schema(f"s{k}")))
                cached.append(await ttft(client, big_schema(f"s{k}")))
            await load(client, 8, 8, 8, SCHEMA)          # warm-up of both paths
            await load(client, 8, 8, 8, None)
            with_schema, without = [], []
            for _ in range(args.reps):
                without.append(await load(client, args.requests, args.concurrency, args.max_tokens, None))
                with_schema.append(await load(client, args.requests, args.concurrency, args.max_tokens, SCHEMA))
                print(f"  without {without[-1]:.1f} tok/s, with schema {with_schema[-1]:.1f} tok/s", flush=True)
        finally:
            await client.close()
    med = statistics.median
    return {"concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens,
            "output_tok_s_without": med(without), "output_tok_s_with_schema": med(with_schema),
            "ratio": med(with_schema) / med(without), "runs_without": without, "runs_with_schema": with_schema,
            "ttft_first_constrained_request_s": first_ever, "ttft_unconstrained_s": med(plain),
            "ttft_new_schema_s": med(new), "ttft_cached_schema_s": med(cached)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--compile-reps", type=int, default=3)
    result = asyncio.run(main(p.parse_args()))
    print(json.dumps(result, indent=2))
    print(f"\noutput tok/s at concurrency {result['concurrency']}: {result['output_tok_s_without']:.1f} without, "
          f"{result['output_tok_s_with_schema']:.1f} with a JSON schema: {result['ratio']:.2f}x")
    print(f"TTFT: unconstrained {1e3 * result['ttft_unconstrained_s']:.0f} ms, new schema "
          f"{1e3 * result['ttft_new_schema_s']:.0f} ms, cached schema {1e3 * result['ttft_cached_schema_s']:.0f} ms, "
          f"first constrained request of the server {1e3 * result['ttft_first_constrained_request_s']:.0f} ms")
