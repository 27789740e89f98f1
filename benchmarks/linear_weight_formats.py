"""Where a decode step's matmul time goes on this CPU, by weight format: the linear layers of one
SmolLM2-135M step (30 layers x qkv, o, gate_up, down, plus the 49152-row LM head), each layer with its own
weights so they stream from DRAM as in the real model.

    python benchmarks/linear_weight_formats.py [--reps 3] [--rows 1 4 16 32 64 128 256] [--formats fp32 "int4 kernel"]

Formats (x is float32, as with dtype=auto on a CPU without native bf16):
  fp32            fp32 weights, MKL sgemm
  bf16            bf16 weights and a bf16 matmul (oneDNN; emulated and slow without AVX-512-BF16/AMX)
  bf16->fp32      bf16 weights converted to fp32 one matrix at a time just before the matmul
  int8->fp32      int8 weights + per-row scales, dequantized per matrix (kvflow's path for big steps)
  int8 kernel     int8 weights read directly by torch._weight_int8pack_mm, bf16 activations (kvflow's path for
                  steps of <= 32 rows and the LM head)
  fp8 torch       e4m3 weights converted by torch's `.to(float32)`
  fp8 bits        e4m3 weights converted by kvflow's bit moves (layers/quantization.to_float)
  int4 kernel     group-32 int4 codes read by torch's int4 CPU kernel, bf16 activations (layers/int4.Int4Linear)
  int4 native     the same codes in GGUF's block layout, kvflow's own kernel (kernels/csrc), float32
                  activations quantized to int8 per group of 32 (the batch-invariant default path)
  int4->fp32      the same codes dequantized per matrix to float32, then MKL (Int4Linear's fallback, fp32 compute)
  int4->bf16      dequantized to bfloat16, then a bf16 matmul (the fallback with bf16 compute)
The LM head of the dequantizing formats is converted in 4096-row slices, as kvflow does (int4: whole).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvflow.kernels.group_quant import GroupQuantized
from kvflow.layers.int4 import Int4Linear
from kvflow.layers.quantization import quantize_rows, to_float

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # qkv, o, gate_up, down: [out, in]
VOCAB, HIDDEN = 49152, 576


def prepare(w: torch.Tensor, fmt: str):
    if fmt == "fp32":
        return w
    if fmt in ("bf16", "bf16->fp32"):
        return w.bfloat16()
    if fmt.startswith("int4"):
        layer = Int4Linear(GroupQuantized.round_to_nearest(w, bits=4, group=32), native=fmt == "int4 native")
        if fmt == "int4 native":
            assert layer.native, "kvflow's native kernels are not available here"
            return layer
        layer.kernel_rows = 1 << 62 if fmt == "int4 kernel" else 0
        return layer
    q, s = quantize_rows(w, "fp8" if fmt.startswith("fp8") else "int8")
    return q, (s.bfloat16() if fmt == "int8 kernel" else s)


def matmul(x: torch.Tensor, w, fmt: str, head: bool = False) -> torch.Tensor:
    if fmt == "fp32":
        return F.linear(x, w)
    if fmt == "bf16":
        return F.linear(x.bfloat16(), w)
    if fmt == "int8 kernel":
        return torch._weight_int8pack_mm(x.bfloat16(), *w).float()
    if fmt.startswith("int4"):
        return w(x.bfloat16() if fmt == "int4->bf16" else x)
    convert = {"bf16->fp32": lambda t: t.float(), "int8->fp32": lambda t: t.float(),
               "fp8 torch": lambda t: t.float(), "fp8 bits": lambda t: to_float(t, torch.float32)}[fmt]
    if fmt == "bf16->fp32":
        chunks = [(c, None) for c in w.split(4096 if head else len(w))]
    else:
        q, s = w
        chunks = list(zip(q.split(4096 if head else len(q)), s.split(4096 if head else len(s))))
    outs = [F.linear(x, convert(c)) * (1 if s is None else s) for c, s in chunks]
    return torch.cat(outs, dim=-1) if head else outs[0]


FORMATS = ("fp32", "bf16", "bf16->fp32", "int8->fp32", "int8 kernel", "fp8 torch", "fp8 bits", "int4 kernel",
           "int4 native", "int4->fp32", "int4->bf16")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    args = ap.parse_args()
    torch.manual_seed(0)
    w32 = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    h32 = torch.randn(VOCAB, HIDDEN) * 0.02
    print(f"{torch.get_num_threads()} threads; ms per decode step of linears [of which the LM head] "
          f"(median of {args.reps})")
    print(f"{'rows':>5}" + "".join(f"{f:>18}" for f in args.formats))
    results = {}
    for fmt in args.formats:
        layers = [[prepare(w, fmt) for w in layer] for layer in w32]
        head = prepare(h32, fmt)
        for m in args.rows:
            xs = {k: torch.randn(m, k) for k in (576, 1536)}
            step_ms, head_ms = [], []
            for _ in range(args.reps + 1):                       # the first pass warms up
                t0 = time.perf_counter()
                for layer, shapes in zip(layers, [SHAPES] * LAYERS):
                    for w, (_, k) in zip(layer, shapes):
                        matmul(xs[k], w, fmt)
                t1 = time.perf_counter()
                matmul(xs[HIDDEN], head, fmt, head=True)
                t2 = time.perf_counter()
                step_ms.append((t2 - t0) * 1e3)
                head_ms.append((t2 - t1) * 1e3)
            results[(fmt, m)] = (statistics.median(step_ms[1:]), statistics.median(head_ms[1:]))
        del layers, head
    for m in args.rows:
        print(f"{m:>5}" + "".join(f"{results[(f, m)][0]:>10.1f} [{results[(f, m)][1]:>5.1f}]" for f in args.formats))


if __name__ == "__main__":
    main()
