"""`kvflow serve [MODEL]`: the OpenAI-compatible server. Its flags are generated from EngineConfig's and
ServerConfig's fields (help text in their metadata) and spelled as vLLM spells them."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal

from kvflow.config import EngineConfig
from kvflow.server.common.config import ServerConfig
from kvflow.server.common.flags import add_config_flags, setup_logging

logger = logging.getLogger("kvflow.server")

# given otherwise: MODEL is positional (or --model), and --served-model-name lists every name (ServerConfig)
ENGINE_FIELDS_NOT_FLAGS = ("model", "served_model_name")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API (chat and completions, "
                                   "streamed or not), with Prometheus metrics at /metrics.")
    help_model = dataclasses.fields(EngineConfig)[0].metadata["help"]
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=help_model)
    p.add_argument("--model", dest="model_opt", default=None, help="same as MODEL")
    add_config_flags(p.add_argument_group("engine"), EngineConfig, skip=ENGINE_FIELDS_NOT_FLAGS)
    add_config_flags(p.add_argument_group("server"), ServerConfig)
    p.set_defaults(func=run_serve)
    return p


def configs_from_args(args) -> tuple[EngineConfig, ServerConfig]:
    """ValueError (a message naming the flag) for values the configs refuse."""
    model = args.model_tag or args.model_opt
    if args.model_tag and args.model_opt and args.model_tag != args.model_opt:
        raise ValueError(f"two different models given: {args.model_tag!r} and --model {args.model_opt!r}")

    def values(cls, skip=()) -> dict:
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in skip}

    server = ServerConfig(**{**values(ServerConfig),
                             "api_key": args.api_key or os.environ.get("KVFLOW_API_KEY")
                             or os.environ.get("VLLM_API_KEY")})
    engine = values(EngineConfig, skip=ENGINE_FIELDS_NOT_FLAGS)
    names = server.served_model_name
    return EngineConfig(**engine, model=model, served_model_name=names[0] if names else None), server


def config_from_args(args) -> EngineConfig:
    return configs_from_args(args)[0]


def run_serve(args) -> int:
    """Exit status: 0 after SIGTERM/SIGINT (in-flight requests drained or failed cleanly), 1 if the engine died."""
    from kvflow.server.app import build_app, build_engine
    from kvflow.server.common.uvicorn_server import EngineServer

    setup_logging(args.log_level)
    config, server_config = configs_from_args(args)   # ValueError -> clean error exit in kvflow.cli
    logger.info("kvflow serve: %s", ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(config).items()))
    if config.node_rank > 0:          # another machine's ranks of a multi-machine run: no server here
        from kvflow.executor.worker import run_worker_node
        return run_worker_node(config)
    logger.info("server: %s", ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(
        dataclasses.replace(server_config, api_key="set" if server_config.api_key else None)).items()))
    engine = build_engine(config, server_config)
    try:
        app = build_app(engine, server_config)
    except BaseException:         # e.g. a --lora-modules adapter refused: stop the engine, then say why
        engine.stop()
        raise
    server = EngineServer(app, server_config)
    # uvicorn re-raises the signal that stopped it once it is done: a no-op SIGTERM handler makes that harmless,
    # so a graceful SIGTERM exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)

    def stop_serving():   # the engine died: its requests got errors; stop the server, exit non-zero below
        server.should_exit = True

    engine.on_death = stop_serving
    logger.info("serving %s on http://%s:%d/v1", ", ".join(app.state.serving.names), server_config.host,
                server_config.port)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if engine.death_reason is not None:
        logger.error("exiting: %s", engine.death_reason)
        return 1
    return 0
