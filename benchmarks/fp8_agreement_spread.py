"""How much of fp8's greedy agreement with bf16 is the format and how much is rounding luck.

    python benchmarks/fp8_agreement_spread.py [--seeds 4]

Runs the quality check of tests/test_quantization.py (perplexity of tests/data/perplexity.txt and 8-token
greedy outputs of its 16 prompts, bf16 compute, compared with bf16 weights) for int8, for fp8 as kvflow
quantizes it (per-channel scale = absmax / 448), and for fp8 with each channel's scale multiplied by a random
factor in [1, 2). Every such scale is an equally valid e4m3 quantization: no value saturates, the relative
rounding error has the same distribution, only where each weight falls between grid points changes. The
spread of the agreement counts over seeds is the noise of the metric at this model size.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_quantization as quality  # noqa: E402  (the test's text, prompts and perplexity)

import kvflow.layers.quantization as quantization  # noqa: E402

_absmax_rows = quantization.quantize_rows


def jittered_rows(seed: int):
    generator = torch.Generator().manual_seed(seed)

    def quantize_rows(weight: torch.Tensor, method: str):
        if method != "fp8":
            return _absmax_rows(weight, method)
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 448.0).clamp(min=1e-12) * (1 + torch.rand(w.shape[0], generator=generator))
        return (w / scale[:, None]).to(torch.float8_e4m3fn), scale
    return quantize_rows


def evaluate(**kw) -> tuple[float, list[list[int]]]:
    llm = quality.make(**kw)
    return quality.perplexity(llm, quality.TEXT), [o.outputs[0].token_ids for o in llm.generate(quality.PROMPTS, quality.GREEDY)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    base_ppl, base = evaluate()
    print(f"bf16 perplexity {base_ppl:.3f}")
    variants = [("int8", {"quantization": "int8"}, None), ("fp8 absmax scale", {"quantization": "fp8"}, None)]
    variants += [(f"fp8 scale x U[1,2) seed {s}", {"quantization": "fp8"}, jittered_rows(s)) for s in range(args.seeds)]
    for name, kw, rows in variants:
        quantization.quantize_rows = rows or _absmax_rows
        ppl, outs = evaluate(**kw)
        agree = sum(a == b for a, b in zip(outs, base))
        print(f"{name:<28} perplexity {(ppl / base_ppl - 1) * 100:+6.2f}%   greedy agreement {agree:>2}/16", flush=True)
    quantization.quantize_rows = _absmax_rows


if __name__ == "__main__":
    main()
