"""Offline throughput: kvflow's LLM.generate versus Hugging Face transformers' static-batch generate,
same prompts, same weights (the embedded SmolLM2, dequantized), same dtype, side by side in one run.

    python benchmarks/offline_throughput.py [--num-prompts 64] [--max-tokens 64] [--reps 3] [--dtype auto]
                                            [--device auto] [--hf-batch-size 64] [--hf-dtype DTYPE]

--hf-dtype sets transformers' dtype apart from kvflow's (default: the same), e.g. the performance issue's
baseline `--hf-dtype bfloat16` against kvflow's `--dtype auto`.

Each side generates exactly max_tokens per prompt (kvflow: ignore_eos; transformers: min_new_tokens).
Reports output tokens per second, the median of --reps runs after one warm-up, and the ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvflow import LLM, SamplingParams
from kvflow.models.loader import default_model_path

TOPICS = ["the ocean", "a city at night", "machine learning", "coffee", "mountains", "a lost key", "trains",
          "the moon", "friendship", "a library", "winter", "robots", "music", "gardening", "rivers", "chess"]


def make_prompts(llm: LLM, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        words = "very " * (i % 7)
        msg = f"Q{i}: write a {words}short story about {TOPICS[i % len(TOPICS)]}."
        prompts.append(llm.tokenizer.apply_chat_template([{"role": "user", "content": msg}]))
    return prompts


def bench_kvflow(llm: LLM, prompts, max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def bench_hf(model, prompts, max_tokens: int, batch_size: int, pad_id: int) -> float:
    total, t0 = 0, time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b:b + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=pad_id)
        total += (out.shape[1] - width) * len(batch)
    return total / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on AMX/AVX-512-BF16 CPUs, else float32")
    ap.add_argument("--hf-batch-size", type=int, nargs="+", default=[64])
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument("--hf-dtype", default=None, help="transformers' dtype (default: kvflow's)")
    args = ap.parse_args()
    from kvflow import platform
    device = platform.pick_device(args.device)
    hf_dtype = platform.pick_dtype(args.hf_dtype or args.dtype, device)

    llm = LLM(dtype=args.dtype, device=str(device), max_model_len=1024, kv_cache_memory="2GiB",
              max_num_seqs=args.num_prompts, max_num_batched_tokens=max(1024, 32 * args.num_prompts))
    prompts = make_prompts(llm, args.num_prompts)
    from transformers import AutoModelForCausalLM
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=hf_dtype).to(device).eval()
    pad = llm.tokenizer.eos_token_id

    bench_kvflow(llm, prompts[:8], 8)                              # warm-up
    bench_hf(hf, prompts[:8], 8, 8, pad)
    results = {"kvflow": []} | {f"hf_bs{b}": [] for b in args.hf_batch_size}
    for _ in range(args.reps):                                     # interleaved: the machine is noisy
        results["kvflow"].append(bench_kvflow(llm, prompts, args.max_tokens))
        for b in args.hf_batch_size:
            results[f"hf_bs{b}"].append(bench_hf(hf, prompts, args.max_tokens, b, pad))
    med = {k: statistics.median(v) for k, v in results.items()}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    kv_dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
    print(f"{args.num_prompts} prompts x {args.max_tokens} tokens, kvflow dtype={args.dtype} ({kv_dtype}), "
          f"transformers {str(hf_dtype).removeprefix('torch.')}, {where}, median of {args.reps}")
    print(f"{'engine':<16}{'output tok/s':>14}{'runs':>40}")
    for k, v in results.items():
        print(f"{k:<16}{med[k]:>14.1f}{'  ' + ', '.join(f'{x:.1f}' for x in v):>40}")
    for b in args.hf_batch_size:
        print(f"kvflow / transformers static batch {b}: {med['kvflow'] / med[f'hf_bs{b}']:.2f}x")


if __name__ == "__main__":
    main()
