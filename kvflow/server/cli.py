"""`kvflow serve [MODEL]`: the OpenAI-compatible server. Its flags are generated from EngineConfig's and
ServerConfig's fields (help text in their metadata) and spelled as vLLM spells them."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import typing

from kvflow.config import EngineConfig
from kvflow.server.config import ServerConfig

logger = logging.getLogger("kvflow.server")

# given otherwise: MODEL is positional (or --model), and --served-model-name lists every name (ServerConfig)
ENGINE_FIELDS_NOT_FLAGS = ("model", "served_model_name")


def add_config_flags(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """One `--field-name` flag per dataclass field: type and default from the field, help from its metadata."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta = dict(f.metadata)
        kw: dict = {"dest": f.name, "default": f.default, "help": meta.pop("help", None)}
        if f.default not in (None, ""):
            kw["help"] = f"{kw['help']} (default: %(default)s)"
        aliases = meta.pop("aliases", ())
        kind = meta.pop("type", None) or next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],)
                                              if t is not type(None))
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is tuple:
            kw["nargs"] = "+"
        else:
            kw["type"] = kind
        parser.add_argument(f"--{f.name.replace('_', '-')}", *aliases, **kw, **meta)


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


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvflow").setLevel(getattr(logging, level.upper()))


def run_serve(args) -> int:
    """Exit status: 0 after SIGTERM/SIGINT (in-flight requests drained or failed cleanly), 1 if the engine died."""
    from kvflow.server.openai_api import build_app, build_engine
    from kvflow.server.uvicorn_server import EngineServer

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
