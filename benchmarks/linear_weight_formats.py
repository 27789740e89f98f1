"""Where a decode step's matmul time goes on this CPU, by weight format: the linear layers of one
SmolLM2-135M step (30 layers x qkv, o, gate_up, down, plus the 49152-row LM head), each layer with its own
weights so they stream from DRAM as in the real model.

    python benchmarks/linear_weight_formats.py [--reps 3]

Formats: fp32 weights (MKL sgemm), bf16 weights with bf16 matmul (oneDNN), and bf16 weights converted to
fp32 one matrix at a time just before the matmul (half the DRAM bytes; the fp32 copy lives in cache).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

LAYERS = 30
SHAPES = [(1728, 576), (576, 576), (3072, 576), (576, 1536)]   # qkv, o, gate_up, down: [out, in]
VOCAB, HIDDEN = 49152, 576


def step(x_by_k: dict[int, torch.Tensor], weights, head, mode: str) -> None:
    for layer in weights:
        for w in layer:
            x = x_by_k[w.shape[1]]
            if mode == "fp32":
                F.linear(x, w)
            elif mode == "bf16":
                F.linear(x.bfloat16(), w)
            else:
                F.linear(x, w.float())
    x = x_by_k[HIDDEN]
    if mode == "fp32":
        F.linear(x, head)
    elif mode == "bf16":
        F.linear(x.bfloat16(), head)
    else:
        for chunk in head.split(4096):
            F.linear(x, chunk.float())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    args = ap.parse_args()
    w32 = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    w16 = [[w.bfloat16() for w in layer] for layer in w32]
    h32 = torch.randn(VOCAB, HIDDEN) * 0.02
    h16 = h32.bfloat16()
    print(f"{torch.get_num_threads()} threads; ms per decode step of linears (median of {args.reps})")
    print(f"{'rows':>5}{'fp32':>10}{'bf16':>10}{'bf16->fp32':>12}")
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        row = []
        for mode, (ws, h) in (("fp32", (w32, h32)), ("bf16", (w16, h16)), ("bf16->fp32", (w16, h16))):
            step(xs, ws, h, mode)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                step(xs, ws, h, mode)
                times.append((time.perf_counter() - t0) * 1e3)
            row.append(statistics.median(times))
        print(f"{m:>5}{row[0]:>10.1f}{row[1]:>10.1f}{row[2]:>12.1f}")


if __name__ == "__main__":
    main()
