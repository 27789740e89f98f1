"""One mixture-of-experts layer's experts (`SparseMoE`, one native call where kvflow's kernels hold them) timed
alone at several step sizes, and eager decode steps of the whole model at batch 1 and 8: where a MoE step's time
goes.

    python benchmarks/moe_experts.py MODEL.gguf [--rows 1 2 8 32] [--threads 2] [--reps 20]

MODEL: a MoE GGUF, e.g. the Granite 1B-A400M-shaped Q4_K_M of docs/performance.md (benchmarks/make_moe_gguf.py,
then llama-quantize). Random activations; the router picks the experts, so the distinct experts read per call are
printed beside each time. Medians of --reps calls after 3 warm-ups.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels import ops
from kvflow.layers.moe import SparseMoE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    llm = LLM(args.model, enforce_eager=True, max_model_len=512, kv_cache_memory="256MiB")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    layer = layers[0]
    print(f"machine: {platform.processor() or platform.machine()}; {len(layers)} MoE layers, native call: "
          f"{layer.native} (gate/up {layer.gate_up_bits}-bit, down {layer.down_bits}-bit codes)")
    ops.set_threads(args.threads)
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, layer.gate.weight.shape[1])
            experts = layer.gate(x)[1].unique().numel()
            for _ in range(3):
                layer(x)
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                layer(x)
                times.append(time.perf_counter() - t)
            ms = statistics.median(times) * 1e3
            print(f"{rows:3d} rows: one layer's experts {ms:.2f} ms ({experts} experts read), "
                  f"x {len(layers)} layers = {ms * len(layers):.1f} ms")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for batch in (1, 8):
        prompts = [[100 + i, 200, 300, 400] for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        t = time.perf_counter()
        llm.generate(prompts, params)
        print(f"eager decode, batch {batch}: {(time.perf_counter() - t) / 32 * 1e3:.1f} ms a step")


if __name__ == "__main__":
    main()
