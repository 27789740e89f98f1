"""`kvflow bench`: load-test any OpenAI-compatible server; `kvflow bench compare A.json B.json ...`;
`kvflow bench --launch "kvflow serve ..." --vary FLAG=V1,V2`: the optimization experiment."""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the bench modules load on use, so that `kvflow --help` starts fast
    from kvflow.bench.result import Result

DESCRIPTION = """Benchmark an OpenAI-compatible server (kvflow, vLLM, llama.cpp's llama-server, SGLang) with
streamed requests and write results.json (every request), report.md and report.html (plots) to --output-dir.

examples:
  kvflow bench --base-url http://127.0.0.1:8000/v1 --workload random --input-len 256 --output-len 128 \\
      --num-requests 200 --concurrency 16 --ignore-eos
  kvflow bench --workload haiku --sweep concurrency=1,4,16,32 --slo ttft=500ms,tpot=50ms --cost-per-hour 1.2
  kvflow bench --launch "kvflow serve --dtype float32" --vary scheduling-policy=static,continuous \\
      --workload haiku --num-requests 64 --concurrency 32
  kvflow bench --workload quote --concurrency 1 --num-requests 8     # answers that copy from the prompt
  kvflow bench --workload quote --num-requests 32 --write-dataset quote.jsonl
  kvflow bench compare results/a/results.json results/b/results.json
"""


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (a number of requests/s, or inf)") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"the rate must be > 0 (or inf), got {text}")
    return v


def parse_sweep(text: str | None) -> tuple[str, list[float]] | None:
    """'concurrency=1,4,16' or 'request-rate=1,2,inf'."""
    if not text:
        return None
    what, sep, values = text.partition("=")
    what = what.strip().replace("_", "-")
    if not sep or what not in ("concurrency", "request-rate", "rate"):
        raise ValueError(f"bad --sweep {text!r}: expected concurrency=1,4,16 or request-rate=1,2,inf")
    try:
        vals = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"bad --sweep values in {text!r}") from None
    if not vals or any(not v > 0 for v in vals):
        raise ValueError(f"--sweep values must be > 0: {text!r}")
    if what == "concurrency" and any(math.isinf(v) or v != int(v) for v in vals):
        raise ValueError(f"--sweep concurrency values must be whole numbers: {text!r}")
    return ("concurrency" if what == "concurrency" else "request_rate", vals)


def add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (load generator and report)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    g.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    g.add_argument("--api", choices=["chat", "completions"], default="chat",
                   help="/v1/chat/completions or /v1/completions (default chat)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=["random", "shared-prefix", "haiku", "quote", "jsonl"], default="random",
                   help="quote: a ~300-token passage of code or prose per request (seeded) with an instruction to "
                        "repeat, edit or extract from it, the answer copying from the prompt (speculative "
                        "decoding's case)")
    g.add_argument("--dataset", default=None, metavar="FILE",
                   help="jsonl workload: one {\"prompt\"|\"messages\", optional \"max_tokens\"} per line")
    g.add_argument("--input-len", type=int, default=128, help="random: prompt tokens (≈ words)")
    g.add_argument("--output-len", type=int, default=None,
                   help="max_tokens per request (default: random 128, shared-prefix 64, haiku 64, quote 128, "
                        "jsonl: the file's)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len×(1±ratio)")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: system prompts (K)")
    g.add_argument("--questions-per-prefix", type=int, default=8, help="shared-prefix: questions each (M)")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: system prompt tokens")
    g.add_argument("--question-len", type=int, default=32, help="shared-prefix: question tokens")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (vLLM's ignore_eos)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", default=None, metavar="JSON", help="extra fields for every request body")
    g.add_argument("--seed", type=int, default=0, help="seeds the workload and the Poisson arrivals")
    g.add_argument("--write-dataset", default=None, metavar="FILE",
                   help="write the workload's --num-requests requests to FILE as a jsonl dataset (the format of "
                        "--workload jsonl) and exit without sending anything")
    g = p.add_argument_group("load")
    g.add_argument("--num-requests", type=int, default=None,
                   help="requests per run (default: the workload's size; random 100)")
    g.add_argument("--duration", type=float, default=None, help="send for this many seconds, then drain")
    g.add_argument("--concurrency", type=int, default=None, help="closed loop: at most N requests in flight")
    g.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="Poisson arrivals per second (default inf: all at once)")
    g.add_argument("--sweep", default=None, metavar="concurrency=1,4,16|request-rate=1,2,inf",
                   help="one run per value, same workload")
    g.add_argument("--warmup", type=int, default=1, help="requests sent before each run, not counted")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take in all")
    g = p.add_argument_group("report")
    g.add_argument("--slo", default=None, metavar="ttft=500ms,tpot=50ms", help="goodput counts requests meeting these")
    g.add_argument("--cost-per-hour", type=float, default=None, metavar="DOLLARS", help="the machine's price")
    g.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics samples")
    g.add_argument("--output-dir", default=None, help="default results/bench-<timestamp>")
    g.add_argument("--save-output-text", action="store_true", help="keep each answer's text in results.json")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("optimization experiment")
    g.add_argument("--launch", default=None, metavar="CMD",
                   help="start this server command (on a free loopback port) instead of using --base-url")
    g.add_argument("--vary", action="append", default=None, metavar="FLAG=V1,V2",
                   help="one variant per value of a --launch flag (repeatable: every combination)")
    g.add_argument("--launch-timeout", type=float, default=300.0, help="seconds to wait for /health")
    p.set_defaults(func=run_bench, _bench_parser=p)

    bsub = p.add_subparsers(dest="bench_command", metavar="{compare}")
    c = bsub.add_parser("compare", help="side-by-side table of results files, with ratios",
                        description="Compare kvflow bench results (results.json files or their folders).")
    c.add_argument("results", nargs="+", metavar="RESULTS.json")
    c.add_argument("--output", "-o", default=None, help="also write the Markdown table here")
    c.set_defaults(func=run_compare)
    return p


def reconstruct_command(args) -> str:
    """The bench command line that reproduces this run (every option that differs from its default)."""
    parser = args._bench_parser
    words = ["kvflow", "bench"]
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",) or isinstance(action, argparse._SubParsersAction):
            continue
        value = getattr(args, action.dest, None)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(value, list):
            for v in value:
                words += [flag, str(v)]
        else:
            words += [flag, "inf" if value == math.inf else str(value)]
    return shlex.join(words)


def build_workload(args):
    from kvflow.bench import workloads as W

    out_len = args.output_len
    if args.workload == "random":
        return W.random_workload(args.num_requests or 100, args.input_len, out_len or 128, args.range_ratio,
                                 args.seed)
    if args.workload == "shared-prefix":
        return W.shared_prefix_workload(args.num_prefixes, args.questions_per_prefix, args.prefix_len,
                                        args.question_len, out_len or 64, args.seed)
    if args.workload == "haiku":
        return W.haiku_workload(args.num_requests or 32, out_len or 64)
    if args.workload == "quote":
        return W.quote_workload(args.num_requests or 32, out_len or 128, args.seed)
    if not args.dataset:
        raise ValueError("--workload jsonl needs --dataset FILE")
    return W.jsonl_workload(args.dataset, out_len)


def run_bench(args) -> int:
    from kvflow.bench.experiment import run_experiment
    from kvflow.bench.launcher import parse_vary
    from kvflow.bench.report import findings, write_reports
    from kvflow.bench.runner import BenchConfig, run_benchmark
    from kvflow.bench.stats import parse_slo

    if args.write_dataset:
        from kvflow.bench.workloads import write_jsonl
        n = write_jsonl(build_workload(args), args.write_dataset, args.num_requests)
        print(f"wrote {n} requests to {args.write_dataset} (run them with --workload jsonl --dataset FILE)")
        return 0
    if args.vary and not args.launch:
        raise ValueError("--vary needs --launch")
    extra = None
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    cfg = BenchConfig(
        base_url=args.base_url, model=args.model, api=args.api, num_requests=args.num_requests,
        duration=args.duration, concurrency=args.concurrency, request_rate=args.request_rate, seed=args.seed,
        warmup=args.warmup, ignore_eos=args.ignore_eos, temperature=args.temperature, timeout=args.timeout,
        slo=parse_slo(args.slo), cost_per_hour=args.cost_per_hour, metrics_interval=args.metrics_interval,
        progress=not args.no_progress, extra_body=extra, keep_text=args.save_output_text, api_key=args.api_key)
    cfg.validate()
    sweep = parse_sweep(args.sweep)
    workload = build_workload(args)
    output_dir = Path(args.output_dir or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    command = reconstruct_command(args)
    try:
        if args.launch:
            result = run_experiment(cfg, workload, args.launch, parse_vary(args.vary), output_dir, sweep,
                                    args.launch_timeout, command=command,
                                    log=lambda m: print(m, file=sys.stderr, flush=True))
        else:
            result = run_benchmark(cfg, workload, sweep, command=command)
    except ConnectionError as e:
        print(f"kvflow bench: {e}", file=sys.stderr)
        return 1
    paths = write_reports(result, output_dir)
    _print_summary(result)
    for f in findings(result):
        print(f"- {f}")
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    from kvflow.bench.report import columns_of
    cols = columns_of(result)
    return 0 if cols and any(run.summary.completed for _, run in cols) else 1


def _print_summary(result: Result) -> None:
    from kvflow.bench.report import columns_of, fmt

    for label, run in columns_of(result):
        s = run.summary
        print(f"{label}: {s.completed} ok, {s.failed} failed in {s.duration_s:.2f} s | "
              f"{fmt(s.request_throughput, '{:.2f}')} req/s, {fmt(s.output_throughput, '{:.1f}')} out tok/s | "
              f"TTFT p50/p95 {fmt(s.ttft_ms.p50, '{:.0f}')}/{fmt(s.ttft_ms.p95, '{:.0f}')} ms | "
              f"TPOT p50 {fmt(s.tpot_ms.p50, '{:.1f}')} ms | E2E p95 {fmt(s.e2e_ms.p95, '{:.0f}')} ms")


def run_compare(args) -> int:
    from kvflow.bench.report import compare_report

    text = compare_report(args.results)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0
