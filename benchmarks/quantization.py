"""Weight quantization side by side on the embedded SmolLM2, in one run: none (float weights: the default before
the GGUF was kept quantized), default (no flag: the GGUF's own 4-bit codes), int8, int4, fp8.

    python benchmarks/quantization.py [--reps 3] [--batch 1 32] [--max-tokens 32] [--dtype auto] [--modes none default]

For each mode: the engine's weight memory, and output tokens per second of LLM.generate at each batch
size (exactly --max-tokens per prompt), median of --reps, modes interleaved within each rep.
"""
from __future__ import annotations

import argparse
import statistics
import time

from kvflow import LLM, SamplingParams

MODES = ("none", "default", "int8", "int4", "fp8")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    modes = args.modes if "none" in args.modes else ["none", *args.modes]       # the reference for the ratios
    llms = {m: LLM(dtype=args.dtype, quantization=None if m == "default" else m, max_model_len=512,
                   kv_cache_memory="256MiB") for m in modes}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = {b: [f"Q{i}: write a short story about the number {i}." for i in range(b)] for b in args.batch}
    for llm in llms.values():
        llm.generate(prompts[args.batch[0]][:1], SamplingParams(max_tokens=2))     # warm-up
    runs = {(m, b): [] for m in modes for b in args.batch}
    for _ in range(args.reps):
        for b in args.batch:
            for m, llm in llms.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts[b], params)
                runs[(m, b)].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
    dtype = str(llms["none"].engine.runner.dtype).removeprefix("torch.")
    print(f"compute dtype {dtype}, {args.max_tokens} tokens per prompt, median of {args.reps} (output tok/s)")
    header = f"{'mode':<8}{'weights MiB':>12}" + "".join(f"{'batch ' + str(b):>12}" for b in args.batch)
    print(header)
    for m, llm in llms.items():
        row = f"{m:<8}{llm.engine.runner.weights_bytes / 2**20:>12.0f}"
        row += "".join(f"{statistics.median(runs[(m, b)]):>12.1f}" for b in args.batch)
        print(row)
    for m in modes[1:]:
        print(f"{m} / none: " + ", ".join(
            f"batch {b} {statistics.median(runs[(m, b)]) / statistics.median(runs[('none', b)]):.2f}x" for b in args.batch))


if __name__ == "__main__":
    main()
