"""Where a decode step's time goes, and how close the matmuls run to this machine's peak.

    python benchmarks/decode_profile.py [--batch 1 32] [--dtype float32 auto] [--steps 16]
                                        [--mode native eager compiled] [--small-step-threads 1 2]

For each dtype setting and batch size: the embedded SmolLM2 decodes `--steps` tokens for `batch` requests
under torch.profiler. A step's wall time is split into matrix multiplication (aten::mm / addmm / linear's
own kernels), attention (scaled_dot_product_attention and what it calls), the KV gather (aten::index),
sampling, the other tensor ops (a compiled step's fused C++ kernels land here), and what no operator accounts for (Python, the scheduler, building the
step's metadata). Modes: `native` is the default engine where the whole decoder is one native call
(runner/native_step.py; its time is the "native decoder step" bucket, the LM head and sampling stay operators);
`eager` and `compiled` run the model layer by layer (KVFLOW_NATIVE_STEP=0), op by op or as compiled graphs. Matmul FLOP/s are the linears' FLOPs (2 x rows x weights per step) over the matmul time,
next to the peak that a torch microbenchmark reaches here in float32 and bfloat16 (2048^3 F.linear).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from kvflow import LLM, SamplingParams
from kvflow.core.messages import AddRequest

MATMUL = {"aten::mm", "aten::addmm", "aten::_addmm_activation", "mkldnn::_linear_pointwise",
          "aten::mkldnn_linear", "onednn::linear",
          "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",       # the GGUF default's 4/8-bit kernels
          "kvflow::x16_linear"}                                                    # (torch's, or kvflow's)
NATIVE_STEP = "kvflow::decoder_step"      # the whole decoder in one native call (runner/native_step.py): its kernels
ATTENTION = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
             "aten::_scaled_dot_product_attention_math", "aten::bmm", "aten::baddbmm", "aten::_softmax",
             "kvflow::paged_attention"}                                              # kvflow's, on AVX2


def peak_gflops(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    # F.linear, as the model calls it: on CPUs without native bf16 it reaches oneDNN's kernels, while
    # `a @ b` in bf16 falls back to a path ~15x slower still
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    F.linear(a, b)
    t = time.perf_counter()
    for _ in range(reps):
        F.linear(a, b)
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9


def linear_weights(llm: LLM) -> int:
    """Weights a token passes through in matmuls: every linear layer plus the LM head."""
    cfg = llm.engine.model_config
    per_layer = 0
    for m in llm.engine.runner.model.layers[0].modules():
        w = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Module) and w is not None and w.dim() == 2:
            per_layer += w.numel()
    return per_layer * cfg.num_hidden_layers + cfg.vocab_size * cfg.hidden_size


def profile_decode(llm: LLM, batch: int, steps: int) -> dict:
    runner = llm.engine.runner
    native = runner.native_step is not None
    if native:      # the native call as one operator under the profiler: its kernels, not Python around them
        call = runner.native_step.__call__

        def recorded(*args):
            with torch.profiler.record_function(NATIVE_STEP):
                return call(*args)
        runner.native_step = recorded
    prompts = [f"Q{i}: write a short story about the number {i}." for i in range(batch)]
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(prompts, warm)
    # prefill outside the profile: profile only decode steps of this batch
    params = SamplingParams(temperature=0.0, max_tokens=steps + steps // 2 + 1, ignore_eos=True)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(AddRequest(f"prof-{batch}-{i}", llm.tokenizer.encode(p), params))
    engine.step()                                      # the prefill step (and the first token)
    t = time.perf_counter()
    for _ in range(steps // 2):                        # unprofiled steps: the profiler's own overhead
        engine.step()
    plain_ms = (time.perf_counter() - t) / (steps // 2) * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t
    while engine.has_unfinished_requests():
        engine.step()
    if native:
        runner.native_step = call.__self__
    buckets = {"matmul": 0.0, "attention": 0.0, "kv gather": 0.0, "sampling": 0.0, "other ops": 0.0}
    if native:
        buckets = {"native decoder step": 0.0, **buckets}
    for e in prof.key_averages():
        us = e.self_cpu_time_total
        if e.key == NATIVE_STEP:
            buckets["native decoder step"] += us
        elif e.key in MATMUL:
            buckets["matmul"] += us
        elif e.key in ATTENTION:
            buckets["attention"] += us
        elif e.key == "aten::index":
            buckets["kv gather"] += us
        elif e.key in ("aten::argmax", "aten::log_softmax", "aten::_log_softmax", "aten::topk"):
            buckets["sampling"] += us
        else:
            buckets["other ops"] += us
    total_ops = sum(buckets.values()) / 1e6
    buckets = {k: v / 1e6 / steps * 1e3 for k, v in buckets.items()}        # ms per step
    buckets["outside operators"] = max(0.0, (wall - total_ops) / steps * 1e3)
    step_ms = wall / steps * 1e3
    flops = 2 * batch * linear_weights(llm)
    return {"step_ms": step_ms, "plain_ms": plain_ms, "buckets": buckets, "matmul_gflops": flops / (buckets["matmul"] / 1e3) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--dtype", nargs="+", default=["float32", "auto"])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--mode", nargs="+", default=["native", "eager", "compiled"],
                    help="native (the whole decoder in one native call, where it runs), eager (layer by layer, "
                         "--enforce-eager), compiled (layer by layer; waits until every compiled decode bucket is "
                         "ready)")
    ap.add_argument("--small-step-threads", type=int, nargs="+", default=[0],
                    help="EngineConfig.small_step_threads to compare, e.g. 1 2 (0: the engine's default)")
    args = ap.parse_args()
    print(f"peak (2048^3 F.linear, {torch.get_num_threads()} threads): float32 {peak_gflops(torch.float32):.0f} "
          f"GFLOP/s, bfloat16 {peak_gflops(torch.bfloat16):.0f} GFLOP/s")
    for dtype, mode, small in ((d, m, t) for d in args.dtype for m in args.mode for t in args.small_step_threads):
        os.environ["KVFLOW_NATIVE_STEP"] = "1" if mode == "native" else "0"
        llm = LLM(dtype=dtype, max_model_len=512, kv_cache_memory="256MiB", enforce_eager=mode != "compiled",
                  compile_batch_sizes=tuple(args.batch), small_step_threads=small or None)
        torch_threads, kernel_threads = llm.engine.runner.step_threads(1)
        if mode == "native" and llm.engine.runner.native_step is None:
            print(f"dtype={dtype}: the native step does not run here (see the boot log)")
            del llm
            continue
        mode_name = f"{mode}, small steps: {torch_threads} torch / {kernel_threads} kernel threads"
        compiled = llm.engine.runner.compiled_decode
        if compiled is not None:
            compiled.wait()
            print(f"compiled buckets {compiled.compile_seconds} (seconds), failed: {compiled.failed}")
        for batch in args.batch:
            r = profile_decode(llm, batch, args.steps)
            parts = ", ".join(f"{k} {v:.1f} ms ({v / r['step_ms']:.0%})" for k, v in r["buckets"].items())
            print(f"dtype={dtype} {mode_name} batch {batch}: {r['step_ms']:.1f} ms per decode step under the profiler ({r['plain_ms']:.1f} ms without); {parts}; "
                  f"matmul {r['matmul_gflops']:.0f} GFLOP/s")
        del llm


if __name__ == "__main__":
    main()
