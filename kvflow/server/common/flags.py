"""Command-line flags generated from a config dataclass's fields (type, default and help from each field), and the
logging set-up: shared by `kvflow serve`, `kvflow run-batch` and `kvflow generate`, none of which needs the app."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing


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


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvflow").setLevel(getattr(logging, level.upper()))
