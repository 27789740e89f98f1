"""kvflow serve versus llama.cpp's llama-server on the same GGUF and the same workloads, in one run.

    python benchmarks/serve_compare.py [--llama-server PATH] [--vllm "LAUNCH COMMAND"] [--model GGUF]
                                       [--concurrency 1 8 32 64] [--waves 1] [--reps 2] [--no-long]
                                       [--kvflow-args "..."]

Workloads (the performance issue's): streamed chat completions, temperature 0, ignore_eos, 64 output tokens,
a ~60-token system prompt shared by every request plus a short question, at each concurrency; and a long one,
~250 prompt tokens and 256 output tokens, 32 requests at concurrency 32. Each level sends
max(4, concurrency * waves) requests (closed loop), after one warm-up request, with kvflow's own bench client.

llama-server runs with `-t <cores> -np 32` (`-np 64` for concurrency 64) and 1,024 tokens of context per slot.
The servers run one at a time, started fresh for each level and alternating, so slow drifts of the machine hit both; each
(server, level) is the median of --reps. kvflow is timed once its background compile of the decode steps has
ended (it serves eagerly from /health on; a steady-state server has long finished). Results: a table on stdout and `serve_compare.json` in --output-dir.

`--vllm` adds vLLM's CPU build as a third server: the whole launch command up to its host and port, e.g.
`"env VLLM_CPU_KVCACHE_SPACE=2 ... /path/to/venv/bin/vllm serve HF_FOLDER --max-model-len 2048 --dtype bfloat16"`
(vLLM does not serve this GGUF: give it a Hugging Face folder of the same weights; ../shared/reference/peers.md
says how to install and start it). Its boot is minutes of torch.compile, so it is started once per repetition and
serves every level of that repetition (after a warm-up request per level, as the others get); it is never a
project dependency.
Never run this while anything else loads the machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from kvflow.bench.launcher import LaunchedServer
from kvflow.bench.runner import BenchConfig, run_benchmark
from kvflow.bench.workloads import random_workload, shared_prefix_workload

LONG = "long"


def workload_for(level, waves: int):
    if level == LONG:
        return random_workload(32, input_len=250, output_len=256, seed=1), 32, 32
    n = max(4, level * waves)
    return shared_prefix_workload(1, n, prefix_len=60, question_len=10, output_len=64, seed=0), n, level


COMPILE_DONE = ("every compiled decode step is ready", "every step runs eagerly from now on")


def wait_for_compiled_steps(server: LaunchedServer, timeout: float = 900.0) -> float:
    """kvflow compiles its decode steps in the background after /health (serving eagerly meanwhile): a benchmark
    of the steady state waits for that to end. Returns the seconds waited."""
    t0 = time.monotonic()
    while not any(line in server.log_tail(200) for line in COMPILE_DONE):
        if time.monotonic() - t0 > timeout or server.proc.poll() is not None:
            raise RuntimeError(f"kvflow's decode steps did not finish compiling:\n{server.log_tail()}")
        time.sleep(0.5)
    return time.monotonic() - t0


def run_level(server: LaunchedServer, level, waves: int) -> dict:
    workload, n, conc = workload_for(level, waves)
    cfg = BenchConfig(base_url=server.base_url, api="chat", num_requests=n, concurrency=conc, ignore_eos=True,
                      temperature=0.0, warmup=1, progress=False, metrics_interval=1.0, timeout=1800.0)
    run = run_benchmark(cfg, workload, command=shlex.join(sys.argv))["runs"][-1]
    s = run["summary"]
    return {"output_throughput": s["output_throughput"], "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p95_ms": s["ttft_ms"]["p95"], "tpot_p50_ms": s["tpot_ms"]["p50"], "itl_p99_ms": s["itl_ms"]["p99"],
            "completed": s["completed"], "failed": s["failed"], "num_requests": n, "concurrency": conc}


def median_of(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
    return {k: statistics.median(r[k] for r in runs if r[k] is not None) if any(r[k] is not None for r in runs)
            else None for k in keys}


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def print_table(levels, results: dict) -> None:
    peers = [name for name in results if name != "kvflow"]
    head = f"{'level':>6} | {'kvflow tok/s':>12} {'TTFT p50':>9} {'p95':>8} {'TPOT p50':>9}"
    for name in peers:
        head += (f" | {name[:11] + ' tok/s':>17} {'TTFT p50':>9} {'p95':>8} {'TPOT p50':>9} | {'tok/s x':>7} "
                 f"{'TPOT x':>7} {'p95 x':>6}")
    print(head)
    print("-" * len(head))
    for level in levels:
        k = results["kvflow"].get(str(level))
        if not k:
            continue
        k = median_of(k)
        row = (f"{str(level):>6} | {fmt(k['output_throughput']):>12} {fmt(k['ttft_p50_ms'], '.0f'):>7}ms "
               f"{fmt(k['ttft_p95_ms'], '.0f'):>6}ms {fmt(k['tpot_p50_ms'], '.0f'):>7}ms")
        for name in peers:
            p = results[name].get(str(level))
            if not p:
                row += " | (not run)"
                continue
            p = median_of(p)
            ratio = k["output_throughput"] / p["output_throughput"] if p["output_throughput"] else None
            tpot = p["tpot_p50_ms"] / k["tpot_p50_ms"] if k["tpot_p50_ms"] and p["tpot_p50_ms"] else None
            ttft = p["ttft_p95_ms"] / k["ttft_p95_ms"] if k["ttft_p95_ms"] and p["ttft_p95_ms"] else None
            row += (f" | {fmt(p['output_throughput']):>17} {fmt(p['ttft_p50_ms'], '.0f'):>7}ms "
                    f"{fmt(p['ttft_p95_ms'], '.0f'):>6}ms {fmt(p['tpot_p50_ms'], '.0f'):>7}ms | "
                    f"{fmt(ratio, '.2f'):>6}x {fmt(tpot, '.2f'):>6}x {fmt(ttft, '.2f'):>5}x")
        print(row)
    if peers:
        print("tok/s x: kvflow output throughput / the peer's; TPOT x and p95 x: the peer's TPOT p50 and TTFT p95 / "
              "kvflow's (above 1: kvflow faster)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=None, help="path to a llama.cpp llama-server binary")
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--no-long", action="store_true", help="skip the long-prompt workload")
    ap.add_argument("--waves", type=int, default=1, help="requests per level = max(4, concurrency * waves)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kvflow-args", default="", help="extra flags for kvflow serve")
    ap.add_argument("--llama-args", default="", help="extra flags for llama-server")
    ap.add_argument("--vllm", default=None, metavar="LAUNCH",
                    help="launch command of a vLLM server up to --host/--port (see the module docstring)")
    ap.add_argument("--vllm-boot-timeout", type=float, default=900.0, help="seconds to wait for vLLM's /health")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t")
    ap.add_argument("--output-dir", default=f"results/serve-compare-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()

    from kvflow.models.loader import default_model_path
    model = args.model or str(default_model_path())
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    levels = list(args.concurrency) + ([] if args.no_long else [LONG])

    def np_for(level) -> int:
        return 64 if level != LONG and level > 32 else 32

    launches = {"kvflow": lambda level: f"kvflow serve {shlex.quote(model)} --max-num-seqs 64 {args.kvflow_args}"}
    if args.llama_server:
        launches["llama-server"] = lambda level: (
            f"{shlex.quote(args.llama_server)} -m {shlex.quote(model)} -t {args.threads} -np {np_for(level)} "
            f"-c {np_for(level) * 1024} {args.llama_args}")

    results: dict[str, dict[str, list]] = {name: {} for name in launches}
    if args.vllm:
        results["vllm"] = {}

    def record(name: str, rep: int, level, r: dict) -> None:
        results[name].setdefault(str(level), []).append(r)
        print(f"rep {rep + 1} {name:>12} level {str(level):>4}: {r['output_throughput']:.1f} tok/s, "
              f"TTFT p50 {fmt(r['ttft_p50_ms'], '.0f')} ms p95 {fmt(r['ttft_p95_ms'], '.0f')} ms, "
              f"TPOT p50 {fmt(r['tpot_p50_ms'], '.0f')} ms, {r['failed']} failed", flush=True)

    for rep in range(args.reps):
        if args.vllm:
            # minutes of boot: one server per repetition, every level on it
            vllm = LaunchedServer(args.vllm, {}, out / f"vllm-rep{rep + 1}.log")
            vllm.start(timeout=args.vllm_boot_timeout)
            print(f"rep {rep + 1}         vllm booted in {vllm.startup_seconds:.0f} s", flush=True)
            try:
                for level in levels:
                    record("vllm", rep, level, run_level(vllm, level, args.waves))
            finally:
                vllm.stop()
        for level in levels:
            for name, launch in launches.items():
                # one server at a time, started fresh for each level: an idle one would still hold memory and
                # threads, and a fresh start gives every level the same conditions
                log = out / f"{name}-rep{rep + 1}-{level}.log"
                with LaunchedServer(launch(level), {}, log) as server:
                    if name == "kvflow" and "--enforce-eager" not in args.kvflow_args:
                        wait_for_compiled_steps(server)
                    r = run_level(server, level, args.waves)
                record(name, rep, level, r)

    (out / "serve_compare.json").write_text(json.dumps(
        {"model": model, "launches": {**{n: launches[n](1) for n in launches}, "vllm": args.vllm}, "levels": [str(x) for x in levels],
         "reps": args.reps, "waves": args.waves, "results": results}, indent=1))
    print(f"\n{Path(model).name}, median of {args.reps}; levels: concurrency (shared 60-token system prompt, "
          f"64 output tokens) and 'long' (250 in, 256 out, 32 at concurrency 32)")
    print_table(levels, results)
    print(f"results: {out / 'serve_compare.json'}")


if __name__ == "__main__":
    main()
