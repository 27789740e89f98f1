"""Compiled against eager decode steps: output tok/s of LLM.generate for a few batch sizes, both engines in one
process, interleaved, medians.

    python benchmarks/compiled_decode.py [--batch 1 32] [--max-tokens 32] [--reps 3] [--dtype auto]

The compiled engine is timed once every bucket is compiled (the compile seconds are printed).
"""
from __future__ import annotations

import argparse
import statistics
import time

from kvflow import LLM, SamplingParams


def tok_per_s(llm: LLM, batch: int, max_tokens: int) -> float:
    prompts = [f"Q{i}: write a short story about the number {i}." for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    kw = dict(dtype=args.dtype, max_model_len=512, kv_cache_memory="512MiB")
    engines = {"eager": LLM(enforce_eager=True, **kw), "compiled": LLM(enforce_eager=False, **kw)}
    compiled = engines["compiled"].engine.runner.compiled_decode
    compiled.wait()
    print(f"compile seconds per bucket (in the compiler process; 0: from the cache): {compiled.compile_seconds}, "
          f"load seconds: {compiled.load_seconds}, failed: {compiled.failed}")
    for llm in engines.values():
        tok_per_s(llm, 2, 4)                                   # warm-up
    for batch in args.batch:
        runs = {name: [] for name in engines}
        for _ in range(args.reps):                             # interleaved: the machine is shared and noisy
            for name, llm in engines.items():
                runs[name].append(tok_per_s(llm, batch, args.max_tokens))
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(f"batch {batch}: " + ", ".join(f"{k} {med[k]:.1f} tok/s (runs {', '.join(f'{x:.1f}' for x in v)})"
                                             for k, v in runs.items())
              + f"; compiled / eager {med['compiled'] / med['eager']:.2f}x")


if __name__ == "__main__":
    main()
