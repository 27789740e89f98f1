"""The decode-step compiler process (`python -m kvflow.runner.compile_worker`, started by compiled_decode.py).

Reads a pickled job on stdin: the engine settings, the model, the serving process's plain module state and,
per bucket, its thread count and where to save its graph. Builds the same model with the same ModelRunner
(enforce_eager, so it starts no compiler of its own; a KV cache of one request, its block count a dynamic
dimension), compiles each bucket with `torch.compile(...).aot_compile` and saves it (atomically), printing
"ready <bucket> <seconds>" after each. Runs on one core at a lower CPU priority (NICE) while serving keeps the
others, and dies with its parent.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import time


# CPU priority and cores: while this process compiles, the serving process runs its eager steps on one core fewer
# (ModelRunner.forward), and this one compiles on one core (Inductor's C++ builds one at a time), so neither waits
# for the other. Measured on 2 cores: at nice 10 beside serving on both cores the compiler got ~10% of a core and a
# busy server never finished compiling (bucket 1 not ready after 150 s); at 19 a test that stepped without pause
# starved it for 15 minutes. Nice 5 still lets the server's event loop and tokenizer threads go first.
NICE = 5


def main() -> int:
    os.nice(NICE)
    from kvflow import platform

    platform.die_with_parent()
    job = pickle.loads(sys.stdin.buffer.read())
    parent = os.getppid()

    import torch

    from kvflow.runner.model_runner import ModelRunner

    config = dataclasses.replace(job["config"], enforce_eager=True, kv_cache_memory=job["kv_cache_memory"])
    runner = ModelRunner(config, job["model_config"], job["model_path"], job["max_model_len"])
    for name, module in runner.model.named_modules():
        for attr, value in job["module_state"].get(name, {}).items():
            setattr(module, attr, value)
    # round to the activation dtype between fused ops where eager does: bf16 greedy tokens then match eager's
    # (without it a tiny random model's greedy run flipped a near-tie one step early)
    torch._inductor.config.emulate_precision_casts = True
    torch._dynamo.config.enable_aot_compile = True
    torch._inductor.config.compile_threads = 1          # one core: the serving process keeps the others
    for bucket, threads, path in job["buckets"]:
        if os.getppid() != parent:
            return 0
        t = time.perf_counter()
        # Inductor bakes the thread count into the C++ kernels: compile each bucket with the count its steps run
        # on (a per-thread setting in OpenMP)
        torch.set_num_threads(threads)
        with torch.inference_mode(), torch._inductor.config.patch({"cpp.threads": threads}):
            ids, positions, meta = runner._padding_step(bucket)
            for attn in runner.model.attention_layers:        # the serving process's cache has its own size
                torch._dynamo.maybe_mark_dynamic(attn.k_cache, 0)
                torch._dynamo.maybe_mark_dynamic(attn.v_cache, 0)
            graph = torch.compile(runner.model.forward, fullgraph=True, dynamic=False).aot_compile(
                ((ids, positions, meta), {}))
        graph.save_compiled_function(path)
        print(f"ready {bucket} {time.perf_counter() - t:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
