"""The default engine's kernels against torch's, end to end, on the embedded model: kvflow's own kernels (float32
compute; what dtype=auto picks wherever they run, batch invariant), the same kernels with bf16 activations and KV
cache (`dtype=bfloat16`), and torch's bf16 int4 / int8 kernels with SDPA attention (what dtype=auto picked on CPUs
with fast bf16 before; `KVFLOW_NATIVE_KERNELS=0` gives it).

    python benchmarks/kernel_paths.py [--batch 1 32] [--max-tokens 64] [--reps 3] [--buckets 1 32]

Both engines live in one process and are timed interleaved once their compiled decode buckets are ready; output
tok/s of LLM.generate with exactly --max-tokens per prompt, median of --reps, and how many greedy completions of
the batch differ from the same prompt run alone (batch invariance), per engine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from kvflow import LLM, SamplingParams


def build(native: bool, buckets: tuple[int, ...], dtype: str = "auto") -> LLM:
    os.environ["KVFLOW_NATIVE_KERNELS"] = "1" if native else "0"       # read when the engine picks its kernels
    try:
        return LLM(dtype=dtype, max_model_len=512, kv_cache_memory="256MiB", compile_batch_sizes=buckets)
    finally:
        os.environ.pop("KVFLOW_NATIVE_KERNELS")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 32])
    args = ap.parse_args()
    engines = {"kvflow kernels (default)": build(True, tuple(args.buckets)),
               "kvflow kernels, bf16": build(True, tuple(args.buckets), "bfloat16"),
               "torch int4 bf16": build(False, tuple(args.buckets))}
    for name, llm in engines.items():
        compiled = llm.engine.runner.compiled_decode
        if compiled is not None:
            compiled.wait()
        print(f"{name}: dtype {llm.engine.runner.dtype}, {llm.engine.runner.weights_bytes / 2**20:.0f} MiB weights")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = {b: [f"Q{i}: write a short story about the number {i}." for i in range(b)] for b in args.batch}
    runs = {(n, b): [] for n in engines for b in args.batch}
    outputs = {}
    for _ in range(args.reps):
        for b in args.batch:
            for name, llm in engines.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts[b], params)
                runs[(name, b)].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
                outputs[(name, b)] = [o.outputs[0].token_ids for o in outs]
    big = max(args.batch)
    print(f"output tok/s, median of {args.reps} (runs); greedy completions of the {big}-prompt batch that differ "
          "from the prompt alone")
    for name, llm in engines.items():
        alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts[big]]
        differ = sum(a != b for a, b in zip(alone, outputs[(name, big)]))
        cells = "  ".join(f"batch {b}: {statistics.median(runs[(name, b)]):.1f} "
                          f"({', '.join(f'{r:.1f}' for r in runs[(name, b)])})" for b in args.batch)
        print(f"{name:>26}  {cells}  differ: {differ}/{big}")
    base = "torch int4 bf16"
    for b in args.batch:
        for name in engines:
            if name != base:
                ratio = statistics.median(runs[(name, b)]) / statistics.median(runs[(base, b)])
                print(f"batch {b}: {name} / torch's = {ratio:.2f}x")


if __name__ == "__main__":
    main()
