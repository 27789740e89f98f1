"""Speculative decoding through the server: `kvflow serve` with speculation off, `ngram` and `suffix`,
the same streamed load from `kvflow bench` against each, on the embedded model; medians of `--reps` and one
Markdown table with the ratios to off, the acceptance rate and mean accepted length, and the issue's goals.

    .venv/bin/python benchmarks/spec_decode.py                    # the issue's table (~15 min after one compile)
    .venv/bin/python benchmarks/spec_decode.py --extra-serve-args '{"disable_by_batch_size": 8}'
    .venv/bin/python benchmarks/spec_decode.py --reps 1 --levels quote:1:2 --extra-serve-args=--enforce-eager

Levels (`--levels`, WORKLOAD:CONCURRENCY:REQUESTS): the quote workload (`kvflow bench --workload quote`: a
~300-token passage of code or prose and an instruction to repeat, edit or extract from it, `--quote-output-len`
128) and the haiku workload (`--haiku-output-len` 64) at concurrency 1, 8 and 32. Greedy (temperature 0) and no
`ignore_eos` (`--ignore-eos` to add it): speculation leaves greedy output unchanged, so every method produces the
same tokens and the answers end where the model ends them. Every level sends its own requests (quote: its own
seed; haiku: "Q{i}: write a haiku" with i numbered on from the previous level's), so neither the prefix cache nor
suffix decoding's cache of recent outputs has seen a measured request before; each server first answers two quote
requests of another seed (16 tokens, not measured).

Each repetition starts one server per method (the order rotates every repetition, so drift hits every method),
each alone, waited for until its background compile of the decode steps has ended (or given up), and runs every
level on it. The first server after a change to kvflow's source compiles its decode steps (minutes on 2 cores; the
graphs are then cached for the others): run this on an otherwise idle machine and a checkout nobody edits meanwhile
(the cache key hashes kvflow's source, so an edit mid-run means another compile).

`--extra-serve-args` (repeatable): a JSON object is merged into every method's `--speculative-config` (e.g.
`{"disable_by_batch_size": 8}`, `{"num_speculative_tokens": 8}`); anything else is split into `kvflow serve` flags
for every server, off included (e.g. `"--max-num-seqs 64"`).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_compare import wait_for_compiled_steps  # noqa: E402

from kvflow.bench.launcher import LaunchedServer  # noqa: E402
from kvflow.bench.result import BenchResult, RunResult  # noqa: E402

PYTHON = sys.executable
METHODS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix"},
}
# sized for ~15 minutes on the 2-core dev machine: 9 servers, each ~20-40 s to start and ~50-80 s of load (estimated
# from the concurrency 1 / 8 / 32 figures of docs/performance.md, ~54 / 100 / 170 tok/s with speculation off)
DEFAULT_LEVELS = "quote:1:6,quote:8:16,quote:32:32,haiku:1:8,haiku:8:16,haiku:32:32"
WARMUP_SEED = 999


def goal_of(workload: str, concurrency: int) -> tuple[float, float | None]:
    """The issue's goal for a level: (output tok/s ratio to off at least, TPOT p50 ratio at most or None)."""
    if workload == "quote" and concurrency == 1:
        return 1.8, 0.6
    if workload == "quote" and concurrency == 8:
        return 1.3, None
    return 0.97, None


def parse_levels(text: str) -> list[tuple[str, int, int]]:
    levels = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or parts[0] not in ("quote", "haiku"):
            raise SystemExit(f"bad level {item!r}: expected quote|haiku:CONCURRENCY:REQUESTS")
        levels.append((parts[0], int(parts[1]), int(parts[2])))
    return levels


def parse_extra(items: list[str]) -> tuple[dict, list[str]]:
    """--extra-serve-args values: JSON objects (merged into the speculative config) and serve flags."""
    spec, flags = {}, []
    for item in items:
        try:
            value = json.loads(item)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            spec.update(value)
        else:
            flags += shlex.split(item)
    return spec, flags


def serve_command(args, method: str, spec_extra: dict, flags: list[str]) -> str:
    words = ["kvflow", "serve"] + ([args.model] if args.model else []) + flags
    config = METHODS[method]
    if config is not None:
        words += ["--speculative-config", json.dumps({**config, **spec_extra})]
    return shlex.join(words)


def bench(server: LaunchedServer, bench_args: list[str], out: Path, timeout: float) -> RunResult:
    """One `kvflow bench` run (a process of its own) against the server: its (last) run."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [PYTHON, "-m", "kvflow.cli", "bench", "--base-url", server.base_url, "--no-progress", "--temperature", "0",
           "--metrics-interval", "1.0", "--output-dir", str(out), *bench_args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    (out / "bench.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"kvflow bench failed ({r.returncode}): {shlex.join(cmd)}\n{(r.stdout + r.stderr)[-2000:]}"
                           f"\n--- server ---\n{server.log_tail()}")
    return BenchResult.from_json(json.loads((out / "results.json").read_text())).runs[-1]


def level_args(args, workload: str, concurrency: int, n: int, index: int, out: Path) -> list[str]:
    common = ["--concurrency", str(concurrency), "--num-requests", str(n), "--warmup", "0"]
    if args.ignore_eos:
        common.append("--ignore-eos")
    if workload == "quote":
        return ["--workload", "quote", "--seed", str(index + 1), "--output-len", str(args.quote_output_len), *common]
    # haiku, numbered on from the previous haiku levels so no level repeats another's prompts
    first = sum(c for w, _, c in args.level_list[:index] if w == "haiku")
    path = out / f"haiku-{first}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": f"Q{i}: write a haiku", "max_tokens": args.haiku_output_len}) + "\n"
                            for i in range(first, first + n)))
    return ["--workload", "jsonl", "--dataset", str(path), *common]


def figures(run: RunResult) -> dict:
    s, sd = run.summary, run.server.spec_decode
    return {"output_throughput": s.output_throughput, "tpot_p50_ms": s.tpot_ms.p50,
            "ttft_p50_ms": s.ttft_ms.p50, "completed": s.completed, "failed": s.failed,
            "output_tokens": s.total_output_tokens,
            "acceptance_rate": sd.acceptance_rate if sd else None,
            "mean_accepted_length": sd.mean_accepted_length if sd else None,
            "drafts": sd.num_drafts if sd else None}


def median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def fmt(x, spec=".1f", suffix="") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def markdown(args, results: dict) -> str:
    lines = ["| workload | concurrency | requests | method | output tok/s | TPOT p50 ms | tok/s ÷ off | TPOT ÷ off "
             "| acceptance rate | mean accepted length | goal | met |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for workload, conc, n in args.level_list:
        key = f"{workload}:{conc}"
        off = results.get(key, {}).get("off", [])
        off_tput = median(r["output_throughput"] for r in off)
        off_tpot = median(r["tpot_p50_ms"] for r in off)
        for method in args.method_list:
            runs = results.get(key, {}).get(method, [])
            if not runs:
                continue
            tput = median(r["output_throughput"] for r in runs)
            tpot = median(r["tpot_p50_ms"] for r in runs)
            acc = median(r["acceptance_rate"] for r in runs)
            mal = median(r["mean_accepted_length"] for r in runs)
            goal, met = "", ""
            r_tput = tput / off_tput if method != "off" and tput and off_tput else None
            r_tpot = tpot / off_tpot if method != "off" and tpot and off_tpot else None
            if method != "off":
                g_tput, g_tpot = goal_of(workload, conc)
                goal = f"≥ {g_tput}x" + (f", TPOT ≤ {g_tpot}x" if g_tpot else "")
                ok = r_tput is not None and r_tput >= g_tput and (g_tpot is None or (r_tpot or 9) <= g_tpot)
                met = "yes" if ok else "**no**"
            acc_pct = None if acc is None else 100 * acc
            lines.append(f"| {workload} | {conc} | {n} | {method} | {fmt(tput)} | {fmt(tpot)} | "
                         f"{fmt(r_tput, '.2f', 'x')} | {fmt(r_tpot, '.2f', 'x')} | "
                         f"{fmt(acc_pct, '.1f', '%')} | {fmt(mal, '.2f')} | {goal} | {met} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default="off,ngram,suffix", help="comma-separated, of off, ngram, suffix")
    ap.add_argument("--levels", default=DEFAULT_LEVELS, help=f"WORKLOAD:CONCURRENCY:REQUESTS,... ({DEFAULT_LEVELS})")
    ap.add_argument("--quote-output-len", type=int, default=128)
    ap.add_argument("--haiku-output-len", type=int, default=64)
    ap.add_argument("--ignore-eos", action="store_true", help="every answer exactly its max_tokens")
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--extra-serve-args", action="append", default=[], metavar="JSON|FLAGS",
                    help="a JSON object: merged into every method's --speculative-config; else serve flags for "
                         "every server (repeatable)")
    ap.add_argument("--ready-timeout", type=float, default=1800, help="seconds for /health and the compile")
    ap.add_argument("--bench-timeout", type=float, default=1800, help="seconds one level may take")
    ap.add_argument("--out", type=Path, default=None, help="default: a new folder under /tmp")
    args = ap.parse_args()
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.method_list or any(m not in METHODS for m in args.method_list):
        raise SystemExit(f"--methods: choose from {', '.join(METHODS)}")
    args.level_list = parse_levels(args.levels)
    spec_extra, flags = parse_extra(args.extra_serve_args)
    out = args.out or Path(tempfile.mkdtemp(prefix="kvflow-spec-"))
    out.mkdir(parents=True, exist_ok=True)
    commands = {m: serve_command(args, m, spec_extra, flags) for m in args.method_list}
    print(f"results in {out}", flush=True)
    for m, c in commands.items():
        print(f"  {m}: {c}", flush=True)

    results: dict[str, dict[str, list[dict]]] = {}
    t_start = time.monotonic()
    for rep in range(args.reps):
        k = rep % len(args.method_list)
        for method in args.method_list[k:] + args.method_list[:k]:      # rotating: drift hits every method
            where = out / f"rep{rep}" / method
            server = LaunchedServer(commands[method], {}, where / "server.log")
            t0 = time.monotonic()
            server.start(timeout=args.ready_timeout)
            try:
                waited, compiled = wait_for_compiled_steps(server, timeout=args.ready_timeout)
                bench(server, ["--workload", "quote", "--seed", str(WARMUP_SEED), "--num-requests", "2",
                               "--concurrency", "2", "--output-len", "16", "--warmup", "0"],
                      where / "warmup", args.bench_timeout)
                print(f"rep {rep} {method}: ready in {time.monotonic() - t0:.0f} s (compile wait {waited:.0f} s, "
                      f"compiled steps {'on' if compiled else 'off'})", flush=True)
                for index, (workload, conc, n) in enumerate(args.level_list):
                    run = bench(server, level_args(args, workload, conc, n, index, where),
                                where / f"{workload}-c{conc}", args.bench_timeout)
                    f = figures(run)
                    results.setdefault(f"{workload}:{conc}", {}).setdefault(method, []).append(f)
                    print(f"rep {rep} {method} {workload} c={conc}: {f['output_throughput']:.1f} out tok/s, TPOT p50 "
                          f"{fmt(f['tpot_p50_ms'])} ms, TTFT p50 {fmt(f['ttft_p50_ms'], '.0f')} ms, "
                          f"{f['output_tokens']} tokens, acceptance {fmt(f['acceptance_rate'], '.2f')}, "
                          f"mean accepted length {fmt(f['mean_accepted_length'], '.2f')}, {f['failed']} failed",
                          flush=True)
            finally:
                server.stop()
            (out / "results.json").write_text(json.dumps({"commands": commands, "levels": args.level_list,
                                                          "results": results}, indent=1))
    table = markdown(args, results)
    header = (f"Speculative decoding through `kvflow serve`, medians of {args.reps} (servers alternating), greedy, "
              f"quote max_tokens {args.quote_output_len}, haiku {args.haiku_output_len}"
              f"{', ignore_eos' if args.ignore_eos else ''}; {time.monotonic() - t_start:.0f} s in all.\n"
              + "".join(f"\n- {m}: `{c}`" for m, c in commands.items())
              + "\n\nGoals: quote c=1 output tok/s ≥ 1.8x off and TPOT p50 ≤ 0.6x; quote c=8 ≥ 1.3x; "
                "quote c=32 and haiku at every level ≥ 0.97x.\n")
    (out / "spec_decode.md").write_text(header + "\n" + table + "\n")
    print("\n" + header + "\n" + table)
    print(f"\n{out / 'spec_decode.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
