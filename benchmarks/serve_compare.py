"""kvflow serve versus llama.cpp's llama-server on the same GGUF files and the same workloads, in one run.

    python benchmarks/serve_compare.py [--llama-server PATH] [--model GGUF [GGUF ...]] [--reps 3]
                                       [--concurrency 1 8 32 64] [--no-long] [--waves 1] [--kv-tokens 32768]
                                       [--kvflow-args "..."] [--llama-args "..."] [--vllm "LAUNCH COMMAND"]
                                       [--co-tenant]

Workloads (the performance issue's): streamed chat completions, temperature 0, ignore_eos, 64 output tokens,
a ~60-token system prompt shared by every request plus a short question, at each concurrency; and a long one,
~250 prompt tokens and 256 output tokens, 32 requests at concurrency 32. Each level sends
max(4, concurrency * waves) requests (closed loop), after one warm-up request, with kvflow's own bench client.

Every `--model` file (default: the embedded SmolLM2-135M-Instruct Q4_1) gets every level; one run makes the whole
table. The servers run one at a time, each started fresh for every (model, level) — an idle one would still hold
memory and threads — and their order alternates from one repetition to the next (kvflow first in repetition 1,
llama-server first in repetition 2, ...), so slow drifts of the machine hit both; each (model, level, server) is the
median of --reps (default 3). kvflow is timed once its background compile of the decode steps has ended
(`kvflow:compiled_decode_buckets_ready` = `_total` on /metrics, or its log says it gave up and serves eagerly; it
serves eagerly from /health on, and a steady-state server has long finished); the compiled graphs are cached on
disk (keyed by, among others, kvflow's source), so only the first start of each model waits for the compiler.

Same KV tokens for both: `--kv-tokens N` (default 32,768) is the total KV cache of each server. llama-server gets
`-c N -np S` (S = 32 slots, 64 for concurrency above 32: N / S tokens per slot, which llama.cpp rounds up to a
multiple of 256 — the total it really holds is used for both); kvflow gets `--kv-cache-memory` of exactly that many
tokens, computed from the file's shape (2 x layers x KV heads x head_dim x the KV dtype's bytes: the dtype
kvflow picks on this machine, or --dtype / --kv-cache-dtype from --kvflow-args) and `--max-model-len 2048`
(at most N). The tokens each server reports at boot are recorded. `--kv-tokens 0`: each server's own default
(llama-server 1,024 tokens per slot, kvflow its default cache). Flags in --kvflow-args / --llama-args come last
and win (a value that starts with a dash goes after '=': `--kvflow-args=--enforce-eager`).

Memory: resident memory (RSS) of each server's whole process tree — the server process and all its descendants
(kvflow's engine process, its compile process) summed — sampled every 0.2 s from the launch on: the peak
(loading included) and the value at the end of the workload. Per (model, level, server), the median over reps.

Results: a Markdown table on stdout (one row per model file and level: kvflow and llama-server output tok/s with
TPOT p50, the throughput ratio, TTFT p95 of both, RSS peak / end of both) and `serve_compare.json` in
--output-dir (every repetition's figures, the launch commands, the medians; rewritten after every measurement, so
an interrupted run keeps what it measured). The servers' logs are kept beside it.

`--vllm` adds vLLM's CPU build as a third server: the whole launch command up to its host and port, e.g.
`"env VLLM_CPU_KVCACHE_SPACE=2 ... /path/to/venv/bin/vllm serve HF_FOLDER --max-model-len 2048 --dtype bfloat16"`
(vLLM does not serve this GGUF: give it a Hugging Face folder of the same weights, and one --model;
../shared/reference/peers.md says how to install and start it). Its boot is minutes of torch.compile, so it is
started once per repetition and serves every level of that repetition (after a warm-up request per level, as the
others get); its memory is its process tree over the repetition. It is never a project dependency.
`--co-tenant` keeps one core busy with a `while True: pass` process for the whole run (both servers alike): how
each server's figures hold beside another process.
Never run this while anything else loads the machine.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from kvflow.bench.launcher import LaunchedServer
from kvflow.bench.runner import BenchConfig, run_benchmark
from kvflow.bench.workloads import random_workload, shared_prefix_workload

LONG = "long"
KVFLOW_MAX_MODEL_LEN = 2048
COMPILE_GAVE_UP = "every step runs eagerly from now on"


# ---------------------------------------------------------------------------------------------- memory
def _tree_pids_proc(pid: int) -> list[int]:
    """pid and its descendants from /proc/<pid>/task/*/children (Linux, no psutil)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                try:
                    with open(f"/proc/{p}/task/{task}/children") as f:
                        todo.extend(int(c) for c in f.read().split())
                except OSError:
                    pass
        except OSError:
            pass
    return out


def _rss_proc(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0          # a zombie has no VmRSS line
    except OSError:
        return None


def tree_rss(pid: int) -> tuple[int, int] | None:
    """(summed RSS bytes, live processes) of pid and every descendant; None once pid is gone."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return None
        total = n = 0
        for p in procs:
            try:
                total += p.memory_info().rss
                n += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total, n
    pids = _tree_pids_proc(pid)
    sizes = [_rss_proc(p) for p in pids]
    if sizes[0] is None:
        return None
    return sum(s for s in sizes if s), sum(1 for s in sizes if s is not None)


class TreeMemory:
    """Samples the summed RSS of a launched server's process tree every `interval` s from its launch on (the
    thread waits for the subprocess to exist: LaunchedServer.start() blocks until /health)."""

    def __init__(self, server: LaunchedServer, interval: float = 0.2):
        self.server, self.interval = server, interval
        self.peak = 0
        self.peak_procs = 0
        self.last = 0
        self.marks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def start(self) -> "TreeMemory":
        self._thread.start()
        return self

    def _sample(self, pid: int) -> bool:
        got = tree_rss(pid)
        if got is None:
            return False
        self.last = got[0]
        if got[0] > self.peak:
            self.peak = got[0]
        self.peak_procs = max(self.peak_procs, got[1])
        return True

    def _run(self) -> None:
        while self.server.proc is None and not self._stop.is_set():
            time.sleep(0.01)
        if self.server.proc is None:
            return
        pid = self.server.proc.pid
        while not self._stop.is_set() and self._sample(pid):
            self._stop.wait(self.interval)

    def mark(self, name: str) -> int:
        """Sample now and keep the value under `name` (e.g. 'ready', 'end')."""
        if self.server.proc is not None:
            self._sample(self.server.proc.pid)
        self.marks[name] = self.last
        return self.last

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(5)
        return {"rss_peak_bytes": self.peak, "rss_end_bytes": self.marks.get("end", self.last),
                "rss_ready_bytes": self.marks.get("ready"), "max_processes": self.peak_procs}


# ---------------------------------------------------------------------------------------------- KV sizing
def model_shape(path: str) -> dict:
    from kvflow.models.gguf_reader import read_gguf

    md = read_gguf(Path(path)).metadata
    arch = md["general.architecture"]
    heads = md[f"{arch}.attention.head_count"]
    kv_heads = md.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = md.get(f"{arch}.attention.key_length") or md[f"{arch}.embedding_length"] // heads
    shape = {"arch": arch, "layers": md[f"{arch}.block_count"], "kv_heads": kv_heads, "head_dim": head_dim,
             "context_length": md.get(f"{arch}.context_length"), "state_bytes": 0}
    from kvflow.models.model_files import resolve_model_files

    cfg = resolve_model_files(Path(path)).config
    if cfg.recurrent is not None:
        # a hybrid: KV in its attention layers only, and a float32 state per request in its recurrent ones
        r = cfg.recurrent
        shape.update(layers=cfg.num_hidden_layers - len(r.layers), kv_heads=cfg.num_key_value_heads,
                     head_dim=cfg.head_dim)
        if r.kind == "short_conv":
            per_layer = (r.conv_kernel - 1) * cfg.hidden_size
        elif r.kind == "gated_delta_net":
            per_layer = ((r.conv_kernel - 1) * (2 * r.num_key_heads * r.key_head_dim + r.num_value_heads
                                                * r.value_head_dim) + r.num_value_heads * r.key_head_dim
                         * r.value_head_dim)
        else:
            inner = r.num_heads * r.head_dim
            per_layer = (r.conv_kernel - 1) * (inner + 2 * r.num_groups * r.state_size) + inner * r.state_size
        shape["state_bytes"] = 4 * per_layer * len(r.layers)
    return shape


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}


def _kvflow_flags(kvflow_args: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", "-q", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    return ap.parse_known_args(shlex.split(kvflow_args))[0]


def kvflow_kv_dtype(model: str, kvflow_args: str) -> str:
    """The dtype of kvflow's KV cache for this file and flags, decided as ModelRunner decides it
    (platform.pick_kv_dtype over the compute dtype). A guess: measure() checks it against kvflow's boot log and
    starts kvflow again with the dtype it logged if they differ."""
    a = _kvflow_flags(kvflow_args)
    try:
        from kvflow import platform
        from kvflow.kernels import build
        from kvflow.models.loader import resolve_model_files, weight_quantization

        device = platform.pick_device(a.device, None)
        quant = weight_quantization(resolve_model_files(model), a.quantization, a.dtype, 1, device.type)
        dtype = build.compute_dtype(device, a.dtype, quant) or platform.pick_dtype(a.dtype, device)
        dtype = platform.pick_kv_dtype(a.kv_cache_dtype, a.dtype, device, dtype)
    except Exception as e:  # noqa: BLE001 - kvflow's internals moved: the boot log corrects the guess
        print(f"(could not work out kvflow's KV dtype ({e!r}); assuming float32 until its boot log says)")
        return "float32"
    return str(dtype).removeprefix("torch.")


def llama_total_ctx(n_ctx: int, slots: int) -> int:
    """The KV tokens llama-server really holds for `-c n_ctx -np slots` (llama_context: n_ctx rounded up to 256,
    split over the slots, each slot's share rounded up to 256)."""
    pad = lambda x: -(-x // 256) * 256  # noqa: E731
    return pad(pad(n_ctx) // slots) * slots


def parse_kv_tokens(name: str, log: str) -> tuple[int | None, str | None]:
    """The KV tokens (and dtype) a server reports at boot: kvflow 'KV cache 0.70 GiB (bfloat16) = 2048 blocks of 16
    tokens; KV cache size: 32,768 tokens, ...', llama-server 'n_slots = 32, n_ctx_slot = 1024' (its KV cache is f16 unless -ctk/-ctv say
    otherwise)."""
    if name == "kvflow":
        found = re.findall(r"KV cache .*\((\w+)\) = \d+ blocks of \d+ tokens; KV cache size: ([\d,]+) tokens", log)
        return (int(found[-1][1].replace(",", "")), found[-1][0]) if found else (None, None)
    found = re.findall(r"n_slots = (\d+), n_ctx_slot = (\d+)", log)
    if found:
        return int(found[-1][0]) * int(found[-1][1]), None
    found = re.findall(r"llama_context: n_ctx\s+=\s+(\d+)", log)    # older llama.cpp, or -lv 4
    return (int(found[-1]), None) if found else (None, None)


# ---------------------------------------------------------------------------------------------- runs
def workload_for(level, waves: int):
    if level == LONG:
        return random_workload(32, input_len=250, output_len=256, seed=1), 32, 32
    n = max(4, level * waves)
    return shared_prefix_workload(1, n, prefix_len=60, question_len=10, output_len=64, seed=0), n, level


def slots_for(level) -> int:
    # one server serves every level of a repetition (a start per level made the run ~3 h): slots for the largest
    return 64


def _gauge(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)", text, re.M)
    return float(m.group(1)) if m else None


def wait_for_compiled_steps(server: LaunchedServer, timeout: float = 900.0) -> tuple[float, bool]:
    """kvflow compiles its decode steps in the background after /health (serving eagerly meanwhile): a benchmark
    of the steady state waits for that to end — every bucket loaded (kvflow:compiled_decode_buckets_ready equal to
    _total, 0 when compiling is off) or the compiler given up (its log says so). Returns (seconds waited,
    whether the compiled steps are in use)."""
    t0 = time.monotonic()
    with httpx.Client(timeout=5.0, trust_env=False) as c:
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"kvflow exited while compiling its decode steps:\n{server.log_tail()}")
            if COMPILE_GAVE_UP in server.log_tail(400):
                return time.monotonic() - t0, False
            try:
                text = c.get(server.root_url + "/metrics").text
            except httpx.HTTPError:
                text = ""
            ready = _gauge(text, "kvflow:compiled_decode_buckets_ready")
            total = _gauge(text, "kvflow:compiled_decode_buckets_total")
            if total is not None and ready is not None and ready >= total:
                return time.monotonic() - t0, total > 0
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"kvflow's decode steps did not finish compiling in {timeout:.0f} s "
                                   f"({ready}/{total} ready):\n{server.log_tail()}")
            time.sleep(0.5)


def run_level(server: LaunchedServer, level, waves: int) -> dict:
    workload, n, conc = workload_for(level, waves)
    cfg = BenchConfig(base_url=server.base_url, api="chat", num_requests=n, concurrency=conc, ignore_eos=True,
                      temperature=0.0, warmup=1, progress=False, metrics_interval=1.0, timeout=1800.0)
    s = run_benchmark(cfg, workload, command=shlex.join(sys.argv)).runs[-1].summary
    return {"output_throughput": s.output_throughput, "ttft_p50_ms": s.ttft_ms.p50,
            "ttft_p95_ms": s.ttft_ms.p95, "tpot_p50_ms": s.tpot_ms.p50, "itl_p99_ms": s.itl_ms.p99,
            "completed": s.completed, "failed": s.failed, "num_requests": n, "concurrency": conc}


def median_of(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float)) and not isinstance(runs[0][k], bool)]
    out = {}
    for k in keys:
        vals = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    out["failed"] = sum(r.get("failed") or 0 for r in runs)     # any failure in any repetition shows
    out["reps"] = len(runs)
    return out


# ---------------------------------------------------------------------------------------------- table
def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def gib(x) -> str:
    return "-" if not x else f"{x / 2**30:.2f}"


def markdown_table(models: list[str], levels: list, results: dict, peers: list[str]) -> str:
    head = ["model file", "level", "kvflow tok/s (TPOT p50)"]
    for p in peers:
        head += [f"{p} tok/s (TPOT p50)", f"ratio vs {p}"]
    head += ["kvflow TTFT p95"] + [f"{p} TTFT p95" for p in peers]
    head += ["kvflow RSS peak / end (GiB)"] + [f"{p} RSS peak / end (GiB)" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]

    def cell(m: dict | None) -> str:
        if not m:
            return "(not run)"
        s = f"{fmt(m['output_throughput'], '.0f')} ({fmt(m['tpot_p50_ms'], '.1f')} ms)"
        return s + (f" **{m['failed']} failed**" if m["failed"] else "")

    for model in models:
        first = True
        for level in levels:
            med = {name: median_of(runs) if (runs := results[model].get(name, {}).get(str(level))) else None
                   for name in ["kvflow", *peers]}
            if not any(med.values()):
                continue
            k = med["kvflow"]
            row = [Path(model).name if first else "", str(level), cell(k)]
            first = False
            for p in peers:
                row.append(cell(med[p]))
                ratio = (k["output_throughput"] / med[p]["output_throughput"]
                         if k and med[p] and med[p]["output_throughput"] else None)
                row.append("-" if ratio is None else f"{ratio:.2f}×")
            for name in ["kvflow", *peers]:
                row.append(f"{fmt(med[name]['ttft_p95_ms'], '.0f')} ms" if med[name] else "-")
            for name in ["kvflow", *peers]:
                m = med[name]
                row.append(f"{gib(m.get('rss_peak_bytes'))} / {gib(m.get('rss_end_bytes'))}" if m else "-")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
def machine() -> dict:
    info = {"cpus": os.cpu_count(), "platform": sys.platform}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        info["cpu"] = re.search(r"^model name\s*:\s*(.+)$", text, re.M).group(1)
        flags = set(re.search(r"^flags\s*:\s*(.+)$", text, re.M).group(1).split())
        info["cpu_flags"] = sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16"})
    except (OSError, AttributeError):
        pass
    return info


def llama_version(binary: str) -> str | None:
    import subprocess

    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout + done.stderr).strip() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=None, help="path to a llama.cpp llama-server binary")
    ap.add_argument("--model", nargs="+", action="extend", default=None, metavar="GGUF",
                    help="GGUF file(s), each gets every level (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--no-long", action="store_true", help="skip the long-prompt workload")
    ap.add_argument("--waves", type=int, default=1, help="requests per level = max(4, concurrency * waves)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; each figure is their median")
    ap.add_argument("--kv-tokens", type=int, default=32768,
                    help="total KV tokens each server holds (0: each server's own default)")
    ap.add_argument("--kvflow-args", default="", help="extra flags for kvflow serve (they win)")
    ap.add_argument("--llama-args", default="", help="extra flags for llama-server (they win)")
    ap.add_argument("--vllm", default=None, metavar="LAUNCH",
                    help="launch command of a vLLM server up to --host/--port (see the module docstring)")
    ap.add_argument("--vllm-boot-timeout", type=float, default=900.0, help="seconds to wait for vLLM's /health")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t")
    ap.add_argument("--compile-timeout", type=float, default=900.0,
                    help="seconds to wait for kvflow's background compile")
    ap.add_argument("--co-tenant", action="store_true",
                    help="keep one core busy (a `while True: pass` process) for the whole run, both servers alike")
    ap.add_argument("--output-dir", default=f"results/serve-compare-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()
    if args.co_tenant:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        atexit.register(busy.kill)

    from kvflow.models.loader import default_model_path
    models = [str(Path(m).resolve()) for m in (args.model or [str(default_model_path())])]
    if args.vllm and len(models) > 1:
        ap.error("--vllm serves its own Hugging Face folder: give one --model with it")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    levels = list(args.concurrency) + ([] if args.no_long else [LONG])

    block = _kvflow_flags(args.kvflow_args).block_size
    shapes = {m: model_shape(m) for m in models}
    kv_dtype = {m: kvflow_kv_dtype(m, args.kvflow_args) for m in models}     # corrected by kvflow's boot log

    def kv_tokens(level) -> int | None:
        """The KV tokens both servers hold at this level (llama.cpp's rounding of -c decides the total)."""
        return llama_total_ctx(args.kv_tokens, slots_for(level)) if args.kv_tokens else None

    def kvflow_launch(model: str, level) -> str:
        flags = "--max-num-seqs 64"
        tokens = kv_tokens(level)
        if tokens:
            s = shapes[model]
            row = s["head_dim"] + 4 if kv_dtype[model] == "int8" else s["head_dim"]     # int8 rows carry a scale
            per_block = 2 * s["layers"] * s["kv_heads"] * row * DTYPE_BYTES[kv_dtype[model]] * block
            budget = -(-tokens // block) * per_block
            if s["state_bytes"]:
                # a hybrid: its 64 live state slots (llama-server: a recurrent cell per slot) on top (live slots take at
                # most half), and the share kvflow sets aside for prefix-cache checkpoints (runner/state_memory.py)
                budget = max(budget + 64 * s["state_bytes"], 2 * 64 * s["state_bytes"]) * 16 // 15 + s["state_bytes"]
            flags += (f" --kv-cache-memory {budget}"
                      f" --max-model-len {min(KVFLOW_MAX_MODEL_LEN, tokens)}")
        return f"kvflow serve {shlex.quote(model)} {flags} {args.kvflow_args}".strip()

    def llama_launch(model: str, level) -> str:
        slots = slots_for(level)
        ctx = args.kv_tokens or slots * 1024
        return (f"{shlex.quote(args.llama_server)} -m {shlex.quote(model)} -t {args.threads} -np {slots} "
                f"-c {ctx} {args.llama_args}").strip()

    launches = {"kvflow": kvflow_launch}
    if args.llama_server:
        launches["llama-server"] = llama_launch
    peers = [n for n in launches if n != "kvflow"] + (["vllm"] if args.vllm else [])
    results: dict[str, dict[str, dict[str, list]]] = {m: {n: {} for n in ["kvflow", *peers]} for m in models}

    host = machine()
    llama_ver = llama_version(args.llama_server) if args.llama_server else None

    def save() -> None:
        medians = {m: {n: {lv: median_of(runs) for lv, runs in per.items()} for n, per in by.items()}
                   for m, by in results.items()}
        (out / "serve_compare.json").write_text(json.dumps(
            {"command": shlex.join(sys.argv), "models": models, "shapes": shapes, "levels": [str(x) for x in levels],
             "reps": args.reps, "waves": args.waves, "kv_tokens": args.kv_tokens,
             "kv_tokens_per_level": {str(lv): kv_tokens(lv) for lv in levels},
             "launches": {m: {**{n: {str(lv): launches[n](m, lv) for lv in levels} for n in launches},
                              "vllm": args.vllm} for m in models},
             "machine": host, "llama_server_version": llama_ver,
             "results": results, "medians": medians}, indent=1))

    def record(model: str, name: str, rep: int, level, r: dict) -> None:
        results[model][name].setdefault(str(level), []).append(r)
        print(f"rep {rep + 1} {Path(model).name} {name:>12} level {str(level):>4}: "
              f"{r['output_throughput']:.1f} tok/s, TTFT p50 {fmt(r['ttft_p50_ms'], '.0f')} ms "
              f"p95 {fmt(r['ttft_p95_ms'], '.0f')} ms, TPOT p50 {fmt(r['tpot_p50_ms'], '.1f')} ms, "
              f"RSS peak {gib(r.get('rss_peak_bytes'))} end {gib(r.get('rss_end_bytes'))} GiB "
              f"({r.get('max_processes')} processes), KV {r.get('kv_tokens')} tokens, {r['failed']} failed",
              flush=True)
        save()

    def measure(name: str, model: str, rep: int, retry: bool = True) -> dict:
        """One server start, every level on it in turn; {level: result}."""
        log = out / f"{Path(model).stem}-{name}-rep{rep + 1}.log"
        first = levels[0]
        server = LaunchedServer(launches[name](model, first), {}, log)
        mem = TreeMemory(server).start()
        runs: dict = {}
        try:
            server.start(timeout=600.0)
            extra = {"startup_s": server.startup_seconds}
            tokens, dtype = parse_kv_tokens(name, log.read_text(errors="replace"))
            if (name == "kvflow" and kv_tokens(first) and tokens != kv_tokens(first) and dtype in DTYPE_BYTES
                    and dtype != kv_dtype[model] and retry):
                print(f"kvflow's KV cache is {dtype}, not {kv_dtype[model]}: starting it again with "
                      f"{kv_tokens(first)} tokens of {dtype}", flush=True)
                kv_dtype[model] = dtype
                redo = True
            else:
                redo = False
                if name == "kvflow":
                    waited, compiled = wait_for_compiled_steps(server, args.compile_timeout)
                    extra.update(compile_wait_s=waited, compiled_steps=compiled)
                mem.mark("ready")
                for level in levels:
                    r = run_level(server, level, args.waves)
                    end = mem.mark("end")
                    runs[level] = {**r, **extra, "rss_peak_bytes": mem.peak, "rss_end_bytes": end,
                                   "rss_ready_bytes": mem.marks.get("ready"),
                                   "max_processes": mem.peak_procs, "kv_tokens": tokens, "kv_dtype": dtype or "f16"}
        finally:
            server.stop()
            mem.stop()
        if redo:
            return measure(name, model, rep, retry=False)
        if kv_tokens(first) and tokens != kv_tokens(first):
            print(f"warning: {name} holds {tokens} KV tokens, not {kv_tokens(first)} (its own flags win?)")
        return runs

    for rep in range(args.reps):
        if args.vllm:
            # minutes of boot: one server per repetition, every level on it
            vllm = LaunchedServer(args.vllm, {}, out / f"vllm-rep{rep + 1}.log")
            mem = TreeMemory(vllm).start()
            vllm.start(timeout=args.vllm_boot_timeout)
            print(f"rep {rep + 1}         vllm booted in {vllm.startup_seconds:.0f} s", flush=True)
            try:
                for level in levels:
                    r = run_level(vllm, level, args.waves)
                    end = mem.mark("end")
                    record(models[0], "vllm", rep, level,
                           {**r, "rss_peak_bytes": mem.peak, "rss_end_bytes": end, "max_processes": mem.peak_procs})
            finally:
                vllm.stop()
                mem.stop()
        # the order of the servers alternates by repetition
        order = list(launches) if rep % 2 == 0 else list(reversed(launches))
        for model in models:
            for name in order:
                for level, r in measure(name, model, rep).items():
                    record(model, name, rep, level, r)

    print(f"\nmedian of {args.reps} repetitions (servers alternating); levels: concurrency (shared 60-token system "
          f"prompt, 64 output tokens, streamed chat, temperature 0, ignore_eos) and 'long' (250 in, 256 out, 32 at "
          f"concurrency 32); KV tokens per server: "
          + (", ".join(f"{lv}: {kv_tokens(lv)}" for lv in levels) if args.kv_tokens else "each server's default")
          + f"; llama-server -t {args.threads}; {host.get('cpu', '?')}, {host['cpus']} CPUs\n")
    print(markdown_table(models, levels, results, peers))
    if peers:
        print("\nratio: kvflow output tok/s / the peer's (above 1: kvflow faster). RSS: the server's process tree "
              "(all its processes summed), peak from launch and at the end of the workload.")
    print(f"results: {out / 'serve_compare.json'}")


if __name__ == "__main__":
    main()
