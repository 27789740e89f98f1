"""Greedy agreement with the exact-weight reference on one GGUF file: kvflow's default and llama.cpp's llama-server.

    python benchmarks/greedy_agreement.py [--model GGUF] [--llama-server PATH] [--tokens 32]
                                          [--variant dtype=bfloat16 ...] [--output-dir DIR]

The reference is kvflow with dtype=float32, which loads a GGUF's weights dequantized to float32 (the file's exact
values; token-exact with transformers on the same weights). Against it, the greedy continuations of 8 fixed
prompts, --tokens (32) tokens each, ignore_eos:
- `kvflow`: kvflow's default for the file (`LLM(model=...)`: on CPU the quantized codes run through kvflow's own
  kernels, K-quants re-rounded where they are);
- each `--variant k=v,k=v` (more EngineConfig fields, e.g. `dtype=bfloat16` or `quantization=none`);
- `llama-server` (with --llama-server PATH; `-np 1`, the prompts one at a time): the same prompt token ids sent
  to its native `/completion` as `"prompt": [ids]` (no tokenizer of its own in between), `temperature 0`,
  `n_predict`, `ignore_eos`, `cache_prompt false`, `return_tokens true`: the generated ids come back as they are.
Per engine: how many of the 8 continuations equal the reference token for token, and the mean length of the
common prefix (of --tokens). Results on stdout and in `greedy_agreement.json` in --output-dir (every token).
Takes a minute or two on the embedded model; a few on a 0.5B file.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import time
from pathlib import Path

import httpx

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "The three laws of thermodynamics are",
    "Q: What is 17 multiplied by 23?\nA:",
    "Photosynthesis is the process by which",
    "Here is a short poem about the autumn rain:\n",
    "The main differences between TCP and UDP are",
]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def parse_variant(text: str) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, sep, v = item.partition("=")
        if not sep:
            raise SystemExit(f"bad --variant {text!r}: expected k=v,k=v")
        out[k.strip().replace("-", "_")] = int(v) if v.strip().isdigit() else v.strip()
    return out


def kvflow_continuations(model: str, prompt_ids: list[list[int]], tokens: int, **engine_args) -> list[list[int]]:
    from kvflow import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with LLM(model=model, max_model_len=1024, **engine_args) as llm:
        # one at a time, as llama-server gets them (kvflow's steps are batch invariant; this keeps it moot)
        return [list(llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids)
                for ids in prompt_ids]


def llama_continuations(binary: str, model: str, prompt_ids: list[list[int]], tokens: int, threads: int,
                        log_path: Path) -> list[list[int]]:
    from kvflow.bench.launcher import LaunchedServer

    launch = f"{shlex.quote(binary)} -m {shlex.quote(model)} -t {threads} -np 1 -c 2048"
    outs = []
    with LaunchedServer(launch, {}, log_path) as server, httpx.Client(timeout=600.0, trust_env=False) as c:
        for ids in prompt_ids:
            r = c.post(server.root_url + "/completion",
                       json={"prompt": ids, "n_predict": tokens, "temperature": 0.0, "ignore_eos": True,
                             "cache_prompt": False, "return_tokens": True, "stream": False})
            r.raise_for_status()
            got = r.json()
            if not got.get("tokens"):
                raise RuntimeError(f"llama-server returned no token ids (return_tokens unsupported?): {got}")
            outs.append(list(got["tokens"]))
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--llama-server", default=None, help="path to a llama.cpp llama-server binary")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--variant", action="append", default=[], metavar="K=V,...",
                    help="another kvflow engine to compare (EngineConfig fields), e.g. dtype=bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t")
    ap.add_argument("--output-dir", default=f"results/greedy-agreement-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()

    from kvflow.models.loader import default_model_path
    from kvflow.tokenizer import Tokenizer

    model = str(Path(args.model or default_model_path()).resolve())
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_model(model)
    prompt_ids = [list(tok.encode(p)) for p in PROMPTS]

    t0 = time.monotonic()
    reference = kvflow_continuations(model, prompt_ids, args.tokens, dtype="float32")
    print(f"reference (kvflow dtype=float32): {time.monotonic() - t0:.0f} s", flush=True)
    engines: dict[str, list[list[int]]] = {}
    runs = [("kvflow", {})] + [(f"kvflow {v}", parse_variant(v)) for v in args.variant]
    for name, engine_args in runs:
        t0 = time.monotonic()
        engines[name] = kvflow_continuations(model, prompt_ids, args.tokens, **engine_args)
        print(f"{name}: {time.monotonic() - t0:.0f} s", flush=True)
    if args.llama_server:
        t0 = time.monotonic()
        engines["llama-server"] = llama_continuations(args.llama_server, model, prompt_ids, args.tokens,
                                                      args.threads, out / "llama-server.log")
        print(f"llama-server: {time.monotonic() - t0:.0f} s", flush=True)

    summary = {}
    print(f"\n{Path(model).name}: greedy {args.tokens}-token continuations of {len(PROMPTS)} prompts against "
          f"kvflow dtype=float32 (the file's exact weights)\n")
    print("| engine | equal to the reference | mean common prefix (tokens) |")
    print("| --- | --- | --- |")
    for name, conts in engines.items():
        prefixes = [common_prefix(c, r) for c, r in zip(conts, reference)]
        equal = sum(1 for c, r in zip(conts, reference) if c == r)
        summary[name] = {"equal": equal, "of": len(PROMPTS), "mean_common_prefix": statistics.mean(prefixes),
                         "common_prefix": prefixes}
        print(f"| {name} | {equal} of {len(PROMPTS)} | {statistics.mean(prefixes):.1f} of {args.tokens} |")
    (out / "greedy_agreement.json").write_text(json.dumps(
        {"model": model, "tokens": args.tokens, "prompts": PROMPTS, "prompt_token_ids": prompt_ids,
         "reference": reference, "continuations": engines, "summary": summary}, indent=1))
    print(f"\nresults: {out / 'greedy_agreement.json'}")


if __name__ == "__main__":
    main()
