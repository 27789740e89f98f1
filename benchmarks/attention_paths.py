"""kvflow's paged-attention kernel against torch's SDPA path, by context length.

    python benchmarks/attention_paths.py [--shape smollm2 qwen2-0.5b] [--kv float16 float32] [--reps 5]

Two workloads per model shape (heads, KV heads, head dim of the embedded SmolLM2 and of a 0.5B Qwen2):
- **prefill**: a chunk of 512 query rows of one sequence whose context ends at 512 .. 8192 tokens (a long prompt
  prefilled in chunks: the last chunk attends to everything before it);
- **decode**: 1 and 8 sequences, one query row each, at 512 .. 8192 tokens of context.

"kernel" is `ops.paged_attention` straight from the paged cache (what kvflow's default runs on a CPU).
"sdpa" is the torch path of `layers/attention.py`: the context gathered by slot with `index_select` (converted
to float32), then one `scaled_dot_product_attention` under an offset-causal mask (decode: no mask, one row). Both
run on all of torch's threads; the time is the median of --reps calls after one warm-up, one layer. Nothing else
may run on the machine meanwhile (2 cores).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvflow.layers import kv_int8
from kvflow.kernels import ops

SHAPES = {"smollm2": (9, 3, 64), "qwen2-0.5b": (14, 2, 64)}
BLOCK = 16
CHUNK = 512


def cache(blocks: int, kv_heads: int, dim: int, kv: str, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g)
    return kv_int8.quantize_rows(x) if kv == "int8" else x.to(getattr(torch, kv))


CLOCK = time.perf_counter


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = CLOCK()
        fn()
        times.append((CLOCK() - t) * 1e3)
    return statistics.median(times)


def run(shape: str, kv: str, reps: int) -> None:
    heads, kv_heads, dim = SHAPES[shape]
    scale = dim ** -0.5
    g = torch.Generator().manual_seed(0)
    for workload, lengths, seqs in (("prefill", (512, 1024, 2048, 4096, 8192), 1),
                                    ("decode", (512, 2048, 8192), 1), ("decode", (512, 2048, 8192), 8)):
        for length in lengths:
            per_seq = -(-length // BLOCK)
            kc, vc = (cache(per_seq * seqs, kv_heads, dim, kv, g) for _ in range(2))
            tables = torch.arange(per_seq * seqs).view(seqs, per_seq)
            if workload == "prefill":
                rows = min(CHUNK, length)
                positions = torch.arange(length - rows, length)
                row_seq = torch.zeros(rows, dtype=torch.long)
            else:
                rows = seqs
                positions = torch.full((seqs,), length - 1)
                row_seq = torch.arange(seqs)
            q = torch.randn(rows, heads, dim, generator=g)
            kernel = median_ms(lambda: ops.paged_attention(q, kc, vc, tables, row_seq, positions, scale),
                               reps)

            def sdpa():
                slots = (tables[:, :, None] * BLOCK + torch.arange(BLOCK)).view(seqs, -1)[:, :length].flatten()
                flat_k = kc.view(-1, kv_heads, kc.shape[-1]).index_select(0, slots)
                flat_v = vc.view(-1, kv_heads, vc.shape[-1]).index_select(0, slots)
                if kv == "int8":
                    flat_k, flat_v = (kv_int8.dequantize_rows(t, torch.float32) for t in (flat_k, flat_v))
                keys = flat_k.float().view(seqs, length, kv_heads, dim).transpose(1, 2)
                values = flat_v.float().view(seqs, length, kv_heads, dim).transpose(1, 2)
                if workload == "prefill":
                    mask = torch.arange(length)[None, :] <= positions[:, None]
                    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask,
                                                          scale=scale, enable_gqa=True)
                return F.scaled_dot_product_attention(q.view(seqs, heads, 1, dim), keys, values, scale=scale,
                                                      enable_gqa=True)
            torch_ms = median_ms(sdpa, reps)
            label = f"{workload} {rows} rows" if workload == "prefill" else f"decode x{seqs}"
            print(f"| {shape} | {kv} | {label} | {length} | {kernel:.2f} | {torch_ms:.2f} | {torch_ms / kernel:.2f}x |",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", default=["smollm2"], choices=SHAPES)
    ap.add_argument("--kv", nargs="+", default=["float16"], choices=["float32", "bfloat16", "float16", "int8"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch's and the kernel's threads (default: all)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time, not the wall clock (with --threads 1: a fair ratio on a "
                         "machine that other work shares, though not a figure to publish)")
    a = ap.parse_args()
    global CLOCK
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.cpu_time:
        CLOCK = time.process_time
    print(f"threads: {torch.get_num_threads()}")
    print("| shape | KV | workload | context | kernel ms | sdpa ms | kernel speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape in a.shape:
        for kv in a.kv:
            run(shape, kv, a.reps)


if __name__ == "__main__":
    main()
