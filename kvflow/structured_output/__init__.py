"""Structured outputs: constrain sampling to a JSON schema, regex, choice list or grammar (llguidance).

    spec = spec_from_request(body)                   # None when the request asks for nothing
    compiled = await compiler.compile_async(spec)    # cached, off the step loop; 400 on a bad schema
    matcher = compiled.matcher()                     # one per sequence (n > 1: one per choice)
    apply_structured_masks(logits, [matcher or None for each row])   # in the sampler, before sampling
    matcher.accept(token_id)                         # after sampling; is_terminated() -> finish

The names load on first use: the request side (spec, and kvflow.server.serving.tool_calls / the server's config that use
it) must not import torch and llguidance, so that `kvflow --help` stays light.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "StructuredSpec": "spec", "spec_from_request": "spec", "json_schema_spec": "spec",
    "GrammarCompiler": "compiler", "CompiledGrammar": "compiler", "grammar_tokenizer": "compiler",
    "Matcher": "matcher",
    "allocate_bitmask": "bitmask", "fill_bitmask": "bitmask", "apply_bitmask": "bitmask",
    "unpack_bitmask": "bitmask", "apply_structured_masks": "bitmask",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
