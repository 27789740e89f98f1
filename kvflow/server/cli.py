"""`kvflow serve [MODEL]`: the OpenAI-compatible server. Flags are spelled as vLLM spells them."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys

logger = logging.getLogger("kvflow.server")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API (chat and completions, "
                                   "streamed or not), with Prometheus metrics at /metrics.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF model folder or GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_opt", default=None, help="same as MODEL")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API answers to (default: the model argument)")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--kv-cache-memory", default=None, help="bytes for the KV cache, e.g. 4GiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-prefill-tokens-while-decoding", type=int, default=0,
                   help="while requests are generating, prefill at most this many prompt tokens per step, so "
                        "their streams do not stall behind a long prompt (0: no cap; see docs/performance.md)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N processes (gloo on CPU, NCCL on CUDA, one GPU each)")
    p.add_argument("--distributed-init-method", default=None, metavar="tcp://HOST:PORT",
                   help="rendezvous of a multi-machine run: an address of node 0 every node can reach "
                        "(default: one machine, a free local port)")
    p.add_argument("--nnodes", type=int, default=1, help="machines; each runs tensor-parallel-size / nnodes ranks")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine's index; node 0 serves HTTP, the others only run their ranks")
    p.add_argument("--scheduling-policy", default="continuous", help="continuous (default), fcfs or static")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("KVFLOW_API_KEY") or os.environ.get("VLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (env KVFLOW_API_KEY)")
    p.add_argument("--max-queue-len", type=int, default=None,
                   help="answer 429 when this many requests are waiting (default: unbounded)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--request-log", default=None, metavar="PATH",
                   help="write one JSON line per finished request to PATH ('-' for stdout)")
    p.add_argument("--log-stats-interval", type=float, default=5.0, help="seconds between stats log lines")
    p.add_argument("--shutdown-grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.set_defaults(func=run_serve)
    return p


def config_from_args(args):
    from kvflow.config import EngineConfig

    model = args.model_tag or args.model_opt
    if args.model_tag and args.model_opt and args.model_tag != args.model_opt:
        raise ValueError(f"two different models given: {args.model_tag!r} and --model {args.model_opt!r}")
    names = args.served_model_name
    if args.max_queue_len is not None and args.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {args.max_queue_len}")
    return EngineConfig(
        model=model,
        tokenizer=args.tokenizer,
        served_model_name=names[0] if names else None,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        quantization=None if args.quantization in (None, "none") else args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_init_method=args.distributed_init_method,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        seed=args.seed,
    )


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvflow").setLevel(getattr(logging, level.upper()))


def run_serve(args) -> int:
    import uvicorn

    from kvflow.async_engine import AsyncEngine
    from kvflow.server.openai_api import build_app

    setup_logging(args.log_level)
    config = config_from_args(args)   # ValueError ("... not supported yet") -> clean error exit in kvflow.cli
    logger.info("kvflow serve: %s", ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(config).items()))
    if config.node_rank > 0:          # another machine's ranks of a multi-machine run: no server here
        from kvflow.executor.worker import run_worker_node
        return run_worker_node(config)
    logger.info("server: host=%s port=%d api_key=%s max_queue_len=%s request_log=%s", args.host, args.port,
                "set" if args.api_key else "none", args.max_queue_len, args.request_log)
    engine = AsyncEngine.from_config(config, max_queue_len=args.max_queue_len, request_log=args.request_log,
                                     log_stats_interval=args.log_stats_interval)
    names = args.served_model_name or [engine.served_model_name]
    app = build_app(engine, api_key=args.api_key, served_model_names=names,
                    shutdown_grace_period=args.shutdown_grace_period)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.log_level == "debug",
        timeout_graceful_shutdown=max(1, int(args.shutdown_grace_period)), timeout_keep_alive=5))
    # uvicorn handles SIGTERM/SIGINT (stop accepting, wait for in-flight requests up to the grace period,
    # then the app's lifespan stops the engine) and re-raises the signal afterwards: a no-op SIGTERM handler
    # makes that re-raise harmless, so a graceful SIGTERM exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)

    def stop_serving():   # the engine died: its requests got errors; stop the server, exit non-zero below
        server.should_exit = True

    engine.on_death = stop_serving
    logger.info("serving %s on http://%s:%d/v1", ", ".join(names), args.host, args.port)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if engine.death_reason is not None:
        logger.error("exiting: %s", engine.death_reason)
        return 1
    return 0
