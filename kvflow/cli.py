"""The `kvflow` command: generate, serve, run-batch, batch report, bench."""
from __future__ import annotations

import argparse
import sys


def _add_generate_parser(sub) -> None:
    from kvflow.config import EngineConfig
    from kvflow.server.common.flags import add_config_flags

    p = sub.add_parser("generate", help="complete one prompt with the engine, offline")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    add_config_flags(p.add_argument_group("engine"), EngineConfig, skip=("served_model_name",))
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    import dataclasses

    from kvflow import LLM, EngineConfig, SamplingParams

    engine = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    with LLM(**engine) as llm:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate([args.prompt], params)[0]
    print(out.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow: a continuous-batching LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    from kvflow.bench.cli import add_bench_parser
    from kvflow.ray.cli import add_ray_batch_flags
    from kvflow.server.cli import add_serve_parser
    from kvflow.server.batch.report import add_batch_parser
    from kvflow.server.run_batch import add_run_batch_parser

    _add_generate_parser(sub)
    add_serve_parser(sub)
    add_ray_batch_flags(add_run_batch_parser(sub))
    add_batch_parser(sub)
    add_bench_parser(sub)
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
