"""The `kvflow` command: generate, serve, bench."""
from __future__ import annotations

import argparse
import sys


def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt with the engine, offline")
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="HF model folder or GGUF file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None)
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from kvflow import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              kv_cache_memory=args.kv_cache_memory)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate([args.prompt], params)[0]
    print(out.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow: a continuous-batching LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    try:
        from kvflow.server.cli import add_serve_parser
        add_serve_parser(sub)
    except ImportError:
        pass
    try:
        from kvflow.bench.cli import add_bench_parser
        add_bench_parser(sub)
    except ImportError:
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
