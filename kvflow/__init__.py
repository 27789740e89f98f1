"""kvflow: a fast, compact LLM inference server with continuous batching over a paged KV cache.

The public names load on first use, so that `kvflow bench` (a pure HTTP client) and `kvflow --help` start
without importing torch and the engine."""
from __future__ import annotations

import importlib

__version__ = "0.1.0"
_LAZY = {"LLM": "kvflow.llm", "SamplingParams": "kvflow.sampling_params", "EngineConfig": "kvflow.config",
         "RequestOutput": "kvflow.outputs", "CompletionOutput": "kvflow.outputs",
         "PoolingParams": "kvflow.pooling_params", "LoRARequest": "kvflow.lora_request",
         "BeamSearchParams": "kvflow.beam_search"}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
