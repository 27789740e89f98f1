"""Tensor parallelism on this machine: offline throughput of TP=1 versus TP=2, side by side in one run,
same prompts and weights (the embedded SmolLM2), greedy, exactly max_tokens per prompt.

    python benchmarks/tensor_parallel.py [--num-prompts 32] [--max-tokens 32] [--reps 3] [--dtype auto]

Both engines live in this process (TP=2's rank 0 here, rank 1 in a spawned worker); runs alternate so that
machine noise hits both. Each engine runs with the torch threads it would have alone: all cores for TP=1,
cores / 2 per rank for TP=2. For TP=2 it also reports where rank 0's time goes: the step broadcast, the
all-reduces (after o_proj, down_proj, the embedding) and the LM-head gather, which include waiting for the
slower rank.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvflow import LLM, SamplingParams

TOPICS = ["the ocean", "a city at night", "machine learning", "coffee", "mountains", "a lost key", "trains",
          "the moon", "friendship", "a library", "winter", "robots", "music", "gardening", "rivers", "chess"]


class Timer:
    """Wraps a function: how often it was called and how long it took in all."""

    def __init__(self, fn):
        self.fn, self.calls, self.seconds = fn, 0, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def generate(llm: LLM, prompts, max_tokens: int, threads: int) -> tuple[float, list[list[int]]]:
    torch.set_num_threads(threads)        # the thread count is per process: set what this engine would use
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    kw = dict(dtype=args.dtype, max_model_len=1024, kv_cache_memory="1GiB", max_num_seqs=args.num_prompts,
              max_num_batched_tokens=max(1024, 32 * args.num_prompts))
    llms = {"TP=1": (LLM(**kw), cores), "TP=2": (LLM(tensor_parallel_size=2, **kw), max(1, cores // 2))}
    tp2 = llms["TP=2"][0].engine
    prompts = [llms["TP=1"][0].tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Q{i}: write a short story about {TOPICS[i % len(TOPICS)]}."}])
        for i in range(args.num_prompts)]
    try:
        for llm, threads in llms.values():                        # warm-up
            generate(llm, prompts[:4], 4, threads)
        tp = tp2.executor.tp                                      # rank 0's collectives, timed from here on
        timers = {"step broadcast": Timer(tp.broadcast_from_first), "all-reduce": Timer(tp.all_reduce),
                  "LM-head gather": Timer(tp.gather_last_dim)}
        tp.broadcast_from_first, tp.all_reduce, tp.gather_last_dim = timers.values()
        steps = Timer(tp2.step)
        tp2.step = steps

        results = {name: [] for name in llms}
        outputs = {}
        for _ in range(args.reps):
            for name, (llm, threads) in llms.items():
                rate, outputs[name] = generate(llm, prompts, args.max_tokens, threads)
                results[name].append(rate)
    finally:
        tp2.shutdown()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"{args.num_prompts} prompts x {args.max_tokens} tokens, {llms['TP=1'][0].engine.runner.dtype}, "
          f"{cores} cores, median of {args.reps}")
    print(f"{'engine':<8}{'threads/rank':>14}{'output tok/s':>14}   runs")
    for name, (llm, threads) in llms.items():
        print(f"{name:<8}{threads:>14}{med[name]:>14.1f}   {', '.join(f'{x:.1f}' for x in results[name])}")
    print(f"TP=2 / TP=1: {med['TP=2'] / med['TP=1']:.2f}x; same tokens: {outputs['TP=1'] == outputs['TP=2']}")
    n = steps.calls
    print(f"TP=2 rank 0, per step ({n} steps, {steps.seconds / n * 1e3:.1f} ms each):")
    for name, t in timers.items():
        print(f"  {name:<16}{t.seconds / n * 1e3:>8.2f} ms  ({t.calls / n:.0f} calls, "
              f"{t.seconds / max(t.calls, 1) * 1e3:.3f} ms each)")


if __name__ == "__main__":
    main()
