"""LoRA adapters through the server: `kvflow serve` on the embedded model with `--enable-lora --max-loras 4
--max-lora-rank 16` and four rank-16 adapters, against the same server's base model and a server without
`--enable-lora`; the load from `kvflow bench` (the haiku prompts, streamed, greedy); medians of `--reps` and one
Markdown table with the issue's goals.

    .venv/bin/python benchmarks/lora.py                       # the issue's table
    .venv/bin/python benchmarks/lora.py --targets all         # adapters on all seven projections
    .venv/bin/python benchmarks/lora.py --all-slots           # slots on all seven projections, q,v adapters
    .venv/bin/python benchmarks/lora.py --reps 1 --requests 8 --single-requests 2 --extra-serve-args=--enforce-eager

The adapters are made on the fly with peft over a Llama of the embedded model's shapes (an HF LlamaConfig built from
the GGUF's config; random weights: only shapes matter for speed): rank 16, lora_alpha 16, targets q_proj,v_proj
(PEFT's default for Llama) or, with `--targets all`, all seven projections. The LoRA server has slots only for
the adapters' targets (`--lora-target-modules`) unless `--all-slots`.

Loads, each on every server where it applies:
- `adapters c=32`: concurrency 32, the requests spread evenly over the four adapters (request i asks for adapter
  i mod 4: a jsonl dataset with a model per line);
- `base c=32`: the same requests on the base model;
- `adapter c=1`: one adapter at concurrency 1;  `base c=1`: the base model at concurrency 1.
Goals: adapters c=32 output tok/s >= 0.8x the base's; adapter c=1 TPOT p50 <= 1.15x the base's. The
ratios are given against the server without --enable-lora (what a user gives up by turning LoRA on and using it)
and against the same server's base model.

Each repetition starts both servers in turn (the order alternates), waits for the background compile of the decode
steps, sends warm-up requests (one per adapter and one to the base model, 8 tokens), then runs every load. The first
server after a change to kvflow's source compiles its decode steps (minutes on 2 cores; cached after): run this on
an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_compare import wait_for_compiled_steps  # noqa: E402
from spec_decode import bench, fmt, median  # noqa: E402

from kvflow.bench.launcher import LaunchedServer  # noqa: E402

NUM_ADAPTERS = 4
RANK = 16
TARGETS = {"qv": ["q_proj", "v_proj"],
           "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def make_adapters(model: str | None, targets: list[str], out: Path) -> list[Path]:
    """NUM_ADAPTERS PEFT adapters of rank RANK over a Llama of the served model's shapes (random weights)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvflow.models.model_files import resolve_model_files

    cfg = resolve_model_files(model).config
    hf = LlamaConfig(vocab_size=64, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                     num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    with torch.device("meta"):          # the base weights are never read: no time spent initialising them
        base = LlamaForCausalLM(hf)
    base = base.to_empty(device="cpu")
    paths = []
    for i in range(NUM_ADAPTERS):
        peft_model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=RANK, target_modules=targets))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        path = out / f"adapter{i}"
        peft_model.save_pretrained(path)
        base = peft_model.unload()
        paths.append(path)
    return paths


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def kernel_path(log: str) -> str:
    """The boot log's lines that say how the matmuls run (quantization, LoRA)."""
    keep = [line.split("kvflow: ", 1)[-1] for line in log.splitlines()
            if "quantization:" in line or "LoRA:" in line or "weights loaded" in line]
    return "; ".join(dict.fromkeys(keep)) or "(not in the log)"


def dataset(path: Path, n: int, first: int, max_tokens: int, models: list[str] | None) -> Path:
    """Haiku prompts "Q{i}: write a haiku" numbered from `first`; request k asks for models[k % len] if given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for k in range(n):
        line = {"prompt": f"Q{first + k}: write a haiku", "max_tokens": max_tokens}
        if models and models[k % len(models)] is not None:
            line["model"] = models[k % len(models)]
        lines.append(json.dumps(line))
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--targets", choices=tuple(TARGETS), default="qv", help="qv: q_proj,v_proj; all: all seven")
    ap.add_argument("--all-slots", action="store_true", help="LoRA slots on all seven projections (default: "
                                                                 "--lora-target-modules = the adapters' targets)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64, help="requests of the concurrency-32 loads")
    ap.add_argument("--single-requests", type=int, default=12, help="requests of the concurrency-1 loads")
    ap.add_argument("--output-len", type=int, default=64, help="max_tokens of every request (haiku's 64)")
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--extra-serve-args", action="append", default=[], metavar="FLAGS",
                    help="kvflow serve flags for both servers (repeatable)")
    ap.add_argument("--ready-timeout", type=float, default=1800)
    ap.add_argument("--bench-timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=None, help="default: a new folder under /tmp")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvflow-lora-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"results in {out}", flush=True)
    adapters = make_adapters(args.model, TARGETS[args.targets], out / "adapters")
    names = [f"a{i}" for i in range(NUM_ADAPTERS)]
    flags = [w for item in args.extra_serve_args for w in shlex.split(item)]
    base_words = ["kvflow", "serve"] + ([args.model] if args.model else []) + flags
    commands = {
        "lora": shlex.join(base_words + ["--enable-lora", "--max-loras", str(NUM_ADAPTERS), "--max-lora-rank",
                                         str(RANK), "--lora-modules", *(f"{n}={p}" for n, p in zip(names, adapters))]
                             + ([] if args.all_slots else ["--lora-target-modules", *TARGETS[args.targets]])),
        "plain": shlex.join(base_words),
    }
    for k, c in commands.items():
        print(f"  {k}: {c}", flush=True)
    # (server, load) -> the loads each server runs: (name, concurrency, requests, models per request)
    loads = {"lora": [("adapters", args.concurrency, args.requests, names), ("base", args.concurrency, args.requests,
                                                                              None),
                      ("adapter", 1, args.single_requests, names[:1]), ("base", 1, args.single_requests, None)],
             "plain": [("base", args.concurrency, args.requests, None), ("base", 1, args.single_requests, None)]}
    results: dict[str, list[dict]] = {}
    paths: dict[str, str] = {}
    t_start = time.monotonic()
    for rep in range(args.reps):
        order = ["lora", "plain"] if rep % 2 == 0 else ["plain", "lora"]
        for server_name in order:
            where = out / f"rep{rep}" / server_name
            server = LaunchedServer(commands[server_name], {}, where / "server.log")
            t0 = time.monotonic()
            server.start(timeout=args.ready_timeout)
            try:
                waited, compiled = wait_for_compiled_steps(server, timeout=args.ready_timeout)
                paths[server_name] = kernel_path(server.log_tail(20000))
                warm = dataset(where / "warmup.jsonl", NUM_ADAPTERS + 1, 10_000, 8,
                               [*names, None] if server_name == "lora" else None)
                bench(server, ["--workload", "jsonl", "--dataset", str(warm), "--concurrency", "5", "--warmup", "0"],
                      where / "warmup", args.bench_timeout)
                print(f"rep {rep} {server_name}: ready in {time.monotonic() - t0:.0f} s (compile wait {waited:.0f} s, "
                      f"compiled steps {'on' if compiled else 'off'})", flush=True)
                first = 0
                for load, conc, n, models in loads[server_name]:
                    data = dataset(where / f"{load}-c{conc}.jsonl", n, first, args.output_len, models)
                    first += n          # no load repeats another's prompts (the prefix cache)
                    run = bench(server, ["--workload", "jsonl", "--dataset", str(data), "--concurrency", str(conc),
                                         "--num-requests", str(n), "--warmup", "0"],
                                where / f"{load}-c{conc}", args.bench_timeout)
                    s = run.summary
                    f = {"output_throughput": s.output_throughput, "tpot_p50_ms": s.tpot_ms.p50, "failed": s.failed}
                    results.setdefault(f"{server_name}:{load}:{conc}", []).append(f)
                    print(f"rep {rep} {server_name} {load} c={conc}: {f['output_throughput']:.1f} out tok/s, TPOT p50 "
                          f"{fmt(f['tpot_p50_ms'])} ms, {f['failed']} failed", flush=True)
            finally:
                server.stop()
            (out / "results.json").write_text(json.dumps({"commands": commands, "results": results}, indent=1))

    def med(key, field):
        return median(r[field] for r in results.get(key, []))

    c = args.concurrency
    rows = ["| server | load | concurrency | output tok/s | TPOT p50 ms | tok/s ÷ plain base | TPOT ÷ plain base "
            "| tok/s ÷ same server's base | TPOT ÷ same server's base | goal | met |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in [f"plain:base:{c}", f"lora:base:{c}", f"lora:adapters:{c}", "plain:base:1", "lora:base:1",
                "lora:adapter:1"]:
        server_name, load, conc = key.split(":")
        tput, tpot = med(key, "output_throughput"), med(key, "tpot_p50_ms")
        p_tput, p_tpot = med(f"plain:base:{conc}", "output_throughput"), med(f"plain:base:{conc}", "tpot_p50_ms")
        s_tput, s_tpot = med(f"lora:base:{conc}", "output_throughput"), med(f"lora:base:{conc}", "tpot_p50_ms")
        ratio = lambda a, b: a / b if a and b else None      # noqa: E731
        goal = met = ""
        if load == "adapters":
            goal = "tok/s ≥ 0.8x base"
            r = ratio(tput, p_tput)
            met = "–" if r is None else ("yes" if r >= 0.8 else "**no**")
        elif load == "adapter":
            goal = "TPOT ≤ 1.15x base"
            r = ratio(tpot, p_tpot)
            met = "–" if r is None else ("yes" if r <= 1.15 else "**no**")
        same = server_name == "lora" and load != "base"
        rows.append(f"| {server_name} | {load} | {conc} | {fmt(tput)} | {fmt(tpot)} | "
                    f"{fmt(ratio(tput, p_tput), '.2f', 'x')} | {fmt(ratio(tpot, p_tpot), '.2f', 'x')} | "
                    f"{fmt(ratio(tput, s_tput) if same else None, '.2f', 'x')} | "
                    f"{fmt(ratio(tpot, s_tpot) if same else None, '.2f', 'x')} | {goal} | {met} |")
    header = (f"LoRA through `kvflow serve` on {cpu_name()}, medians of {args.reps} (servers alternating); "
              f"{NUM_ADAPTERS} adapters of rank {RANK} on {','.join(TARGETS[args.targets])}; haiku prompts, greedy, "
              f"max_tokens {args.output_len}; {time.monotonic() - t_start:.0f} s in all.\n"
              + "".join(f"\n- {k}: `{v}`" for k, v in commands.items())
              + "".join(f"\n- kernel path ({k}): {v}" for k, v in paths.items())
              + "\n\nGoals: adapters at concurrency 32 output tok/s ≥ 0.8x the base's; one adapter at "
                "concurrency 1 TPOT p50 ≤ 1.15x the base's (ratios against the server without --enable-lora).\n")
    table = "\n".join(rows)
    (out / "lora.md").write_text(header + "\n" + table + "\n")
    print("\n" + header + "\n" + table)
    print(f"\n{out / 'lora.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
