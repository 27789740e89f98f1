"""kvflow on a Ray cluster (the optional extra: `pip install 'kvflow[ray]'`).

`run_batch` (`kvflow run-batch --ray [ADDRESS] --replicas N`): a batch file sharded with Ray Data over an actor
pool of kvflow engines, one per actor, each running its lines through the server's routes as `kvflow run-batch`
does; the driver writes the results (`batch.py`). Nothing imports Ray until it is called (`extra.py`), so
`kvflow --help` and every other command work without it. The names load on first use, as `kvflow`'s do."""
from __future__ import annotations

import importlib

_LAZY = {"run_batch": "kvflow.ray.batch", "RayBatchSettings": "kvflow.ray.batch", "require_ray": "kvflow.ray.extra",
         "EXTRA_HINT": "kvflow.ray.extra"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvflow.ray' has no attribute {name!r}")
