"""Compiled decode steps: the model forward through `torch.compile` (Inductor; C++ kernels on CPU) for steps that
only decode, one graph per batch-size bucket.

Why: at batch 1 a decode step is ~30 layers x ~15 small operators plus their Python, which cost more than the
matrix products on a 135M model (docs/performance.md). Inductor fuses the norms, rotary, residual adds, cache
writes and the attention's softmax into a few C++ loops per layer and drops the Python.

How:
- a decode-only step of n rows runs the graph of the smallest bucket >= n; the runner pads it with rows that
  write their K/V to the scratch block and read only it (their outputs are dropped);
- the block-table width (the longest context) is a dynamic dimension, so one graph per bucket serves every
  context length;
- the buckets are compiled smallest first on a background thread at start-up; the engine serves eagerly until
  a bucket is ready (boot time does not grow), and eagerly for steps with prefill chunks or above the largest
  bucket;
- any failure (compiling, or a compiled step raising) is logged once and turns compilation off: every later
  step runs eagerly. A step that fails is rerun eagerly; rewriting the same K/V slots is harmless.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from kvflow.layers.attention_metadata import AttentionMetadata
from kvflow.runner.step import StepBatch

log = logging.getLogger("kvflow")


class CompiledDecode:
    """`start(make_inputs)`: `make_inputs(bucket)` gives the (ids, positions, metadata) of a decode step of that
    many padding rows, which the warm-up thread runs to compile the bucket's graph."""

    def __init__(self, model: torch.nn.Module, buckets: tuple[int, ...], threads_for: Callable[[int], int]):
        self.buckets = tuple(sorted(buckets))
        self.threads_for = threads_for      # rows -> the threads a step of that size runs on (baked into its graph)
        self.ready: set[int] = set()
        self.failed = False
        self.compile_seconds: dict[int, float] = {}
        self.steps = 0                      # decode steps run compiled
        # the decode graphs differ per bucket by their static batch size only; give dynamo room for all of them
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(self.buckets) + 4)
        # round to the activation dtype between fused ops where eager does: bf16 greedy tokens then match eager's
        # (without it a tiny random model's greedy run flipped a near-tie one step early)
        torch._inductor.config.emulate_precision_casts = True
        self._graph = torch.compile(model, fullgraph=True, dynamic=False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def bucket_for(self, batch: StepBatch) -> int | None:
        """The compiled bucket that would run this step, or None (eager)."""
        if self.failed or batch.num_decodes != len(batch.num_new_tokens):
            return None
        bucket = next((b for b in self.buckets if b >= batch.num_decodes), None)
        return bucket if bucket in self.ready else None

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The compiled forward, or None when it failed (the caller runs the step eagerly)."""
        try:
            hidden = self._graph(ids, positions, meta)
            self.steps += 1
            return hidden
        except Exception:  # noqa: BLE001 - any failure: serve eagerly from now on
            self._fail("a compiled decode step failed")
            return None

    def start(self, make_inputs: Callable[[int], tuple]) -> None:
        def run() -> None:
            with torch.inference_mode():
                for bucket in self.buckets:
                    if self._stop.is_set() or self.failed:
                        return
                    t = time.perf_counter()
                    try:
                        # dynamo guards on the thread count, and Inductor bakes it into the C++ kernels: compile
                        # each bucket with the count its steps will run on (a per-thread setting in OpenMP)
                        threads = self.threads_for(bucket)
                        torch.set_num_threads(threads)
                        with torch._inductor.config.patch({"cpp.threads": threads}):
                            self._graph(*make_inputs(bucket))
                    except Exception:  # noqa: BLE001
                        self._fail(f"compiling the decode step for batch size {bucket} failed")
                        return
                    self.compile_seconds[bucket] = time.perf_counter() - t
                    self.ready.add(bucket)
                    log.info("compiled decode step for batch size <= %d ready (%.1f s)", bucket,
                             self.compile_seconds[bucket])
            log.info("every compiled decode step is ready (%.1f s)", sum(self.compile_seconds.values()))

        self._thread = threading.Thread(target=run, name="kvflow-compile", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every bucket is compiled (or compilation failed); True when all are ready."""
        if self._thread is not None:
            self._thread.join(timeout)
        return len(self.ready) == len(self.buckets)

    def stop(self) -> None:
        """Compile no further bucket (the one being compiled finishes)."""
        self._stop.set()

    def _fail(self, what: str) -> None:
        if not self.failed:
            self.failed = True
            log.warning("%s; every step runs eagerly from now on", what, exc_info=True)
