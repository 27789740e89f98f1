"""kvflow's 4-, 5- and 8-bit matmul kernels (layout x16: 16 weight rows interleaved) per instruction set, on the
embedded model's matrix shapes: AVX2 (`vpmaddubsw`) and, where the CPU has it, AVX-512 VNNI (`vpdpbusd`). Both give
the same bits (tests/test_native_kernels.py).

    python benchmarks/linear_layouts.py [--rows 1 4 8 16 32 64] [--threads 1 2] [--bits 4 5 8] [--reps 7]

Each cell is the median time of one pass over the embedded model's seven matrices of a layer (q, k, v, o, gate, up,
down: 576 -> 576 / 192 / 1536, 1536 -> 576), the instruction sets timed interleaved; GB/s counts the weight bytes
read once per pass. Random codes and scales: the kernels' speed does not depend on their values. (Until b1f65fd an
AVX2 machine ran a second layout, GGUF's rows as stored, by a row-by-row kernel: this script at that commit
compares it, and docs/measurements/linear_layouts-avx2-x16-xeon.txt has its figures.)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvflow.kernels import build, layout, ops

from kvflow.kernels.formats import FORMATS


def _linear(bits: int):
    return lambda x, codes, scale, minimum=torch.empty(0): ops.x16_linear(x, codes, scale, minimum, bits)


q4_linear, q5_linear, q8_linear = (_linear(bits) for bits in (4, 5, 8))

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]   # (N, K)


def weights(bits: int, g: torch.Generator) -> list[tuple]:
    """(kernel, K, packed codes and scales) per matrix of the layer."""
    out = []
    for n, k in SHAPES:
        scale = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
        d = layout.pack_scales(scale, compact=True)
        if bits == 4:
            codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
            out.append((q4_linear, k, FORMATS[4].pack_codes(codes), d, layout.minimums(-8 * scale, scale)))
        elif bits == 5:
            out.append((q5_linear, k, FORMATS[5].pack_codes(torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8)),
                        d))
        else:
            out.append((q8_linear, k, FORMATS[8].pack_codes(torch.randint(-128, 128, (n, k), generator=g,
                                                                  dtype=torch.int8)), d))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 5, 8])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--passes", type=int, default=20, help="passes over the layer per timed repetition")
    args = ap.parse_args()
    lib = build.library()
    if lib is None:
        raise SystemExit("kvflow's kernels cannot run here")
    variants = [("AVX2", 0)] + ([("AVX-512 VNNI", 1)] if build.has_avx512_vnni() else [])
    print(f"kvflow kernels, isa() = {build.isa()}; median of {args.reps} x {args.passes} passes over one layer")
    print("| bits | rows | threads | " + " | ".join(f"{name}: us (GB/s)" for name, _ in variants) + " |")
    print("| --- " * (3 + len(variants)) + "|")
    try:
        for bits in args.bits:
            g = torch.Generator().manual_seed(bits)
            layer = weights(bits, g)
            nbytes = sum(sum(t.numel() * t.element_size() for t in w[2:]) for w in layer)
            for rows in args.rows:
                x = torch.randn(rows, max(k for _, k in SHAPES), generator=g)
                for threads in args.threads:
                    ops.set_threads(threads)
                    times = {name: [] for name, _ in variants}
                    for _ in range(args.reps):
                        for name, avx512 in variants:
                            lib.kvflow_x16_use_avx512(avx512)
                            t0 = time.perf_counter()
                            for _ in range(args.passes):
                                for fn, k, *w in layer:
                                    fn(x[:, :k], *w)
                            times[name].append((time.perf_counter() - t0) / args.passes)
                    cells = [f"{statistics.median(times[name]) * 1e6:,.0f} "
                             f"({nbytes / statistics.median(times[name]) / 1e9:.1f})" for name, _ in variants]
                    print(f"| {bits} | {rows} | {threads} | " + " | ".join(cells) + " |", flush=True)
    finally:
        lib.kvflow_x16_use_avx512(int(build.isa() == "avx512"))
        ops.set_threads(None)


if __name__ == "__main__":
    main()
