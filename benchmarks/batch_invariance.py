"""Does a request's greedy output depend on what shares its steps? Each prompt alone against all of them at
once, same engine, default settings (or the engine flags given), and the output tok/s of the batched run.

    python benchmarks/batch_invariance.py [--prompts 32] [--max-tokens 32] [--engine-args dtype=float32 ...]

Prints how many of the completions differ between alone and batched, and where the first one diverges.
"""
from __future__ import annotations

import argparse
import time

from kvflow import LLM, SamplingParams


def parse_value(v: str):
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    try:
        return int(v)
    except ValueError:
        return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--engine-args", nargs="*", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    kw = dict(max_model_len=1024, kv_cache_memory="512MiB")
    kw.update({k: parse_value(v) for k, v in (a.split("=", 1) for a in args.engine_args)})
    llm = LLM(**kw)
    compiled = llm.engine.runner.compiled_decode
    if compiled is not None:
        compiled.wait()                       # time and compare with every decode bucket compiled
    topics = ["the sea", "a city at night", "prime numbers", "an old clock", "coffee", "the moon", "rain", "a cat"]
    prompts = [f"Q{i}: write a short story about {topics[i % len(topics)]}, part {i}." for i in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t = time.perf_counter()
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    seconds = time.perf_counter() - t
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    differ = [i for i, (a, b) in enumerate(zip(alone, batched)) if a != b]
    first = [next(j for j, (x, y) in enumerate(zip(alone[i], batched[i])) if x != y) for i in differ]
    print(f"engine {kw}: {len(differ)}/{len(prompts)} greedy completions differ between alone and batched "
          f"(first differing token index: {first}); batched {sum(map(len, batched)) / seconds:.1f} output tok/s")


if __name__ == "__main__":
    main()
