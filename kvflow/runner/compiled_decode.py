"""Compiled decode steps: the model forward through `torch.compile` (Inductor; C++ kernels on CPU) for steps that
only decode, one graph per batch-size bucket.

Why: at batch 1 a decode step is ~30 layers x ~15 small operators plus their Python, which cost more than the
matrix products on a 135M model (docs/performance.md). Inductor fuses the norms, rotary, residual adds, cache
writes and the attention's softmax into a few C++ loops per layer and drops the Python.

How:
- a decode-only step of n rows runs the graph of the smallest bucket >= n; the runner pads it with rows that
  write their K/V to the scratch block and read only it (their outputs are dropped);
- the block-table width (the longest context) and the KV cache's block count are dynamic dimensions, so one
  graph per bucket serves every context length and every cache size;
- the graphs are compiled in a CHILD PROCESS (`compile_worker.py`, on one core at nice 5 while eager steps run on
  the other cores), which builds the same model from the same settings, compiles each bucket with torch's precompile API
  (`torch.compile(...).aot_compile`) and saves it under $KVFLOW_CACHE_DIR (default ~/.cache/kvflow)/
  compiled_decode, keyed by everything the graph depends on (`cache_key`). This process only LOADS saved graphs
  (no tracing, ~tens of ms a bucket once Inductor's own cache holds their C++), on the engine thread between
  steps (`poll`, from `bucket_for` and the server's idle loop). Why a process: tracing patches
  `torch.nn.Module.__call__` globally, so tracing on one thread while another runs the same model eagerly
  broke the eager forward (a race now closed); a compile thread inside Inductor also aborted the process at exit;
- the engine serves eagerly until a bucket is loaded (boot time does not grow), and eagerly for steps with
  prefill chunks or above the largest bucket; a second start with the same key loads every bucket at once;
- any failure (the child failing, a graph that does not load, a compiled step raising) is logged once and
  turns compilation off: every later step runs eagerly. A step that fails is rerun eagerly; rewriting the same
  K/V slots is harmless. `stop()` (the runner's shutdown) kills the child: exit never waits for a compile.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from kvflow.layers.attention_metadata import AttentionMetadata
from kvflow.runner.step import StepBatch

log = logging.getLogger("kvflow")

FORMAT = 1          # bump when what is saved changes shape
# saved graphs kept in the cache folder besides this engine's own (each code change or model makes new keys;
# a graph of the embedded model is ~0.35 MB): the least recently used beyond this are deleted at start
MAX_SAVED = 64


def cache_root() -> Path:
    """Where kvflow keeps built things (kernels/build.py builds the native library there too)."""
    return Path(os.environ.get("KVFLOW_CACHE_DIR") or Path.home() / ".cache" / "kvflow")


@functools.cache
def kvflow_source_hash() -> str:
    """Every .py and .c file of the kvflow package: a code change gives new graphs."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c") and p.is_file()):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def model_identity(path: Path) -> list:
    """A model file (or every file of a model folder) by name, size and modification time."""
    path = Path(path).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [str(path)] + [(str(f.relative_to(path)) if path.is_dir() else f.name, f.stat().st_size,
                           f.stat().st_mtime_ns) for f in files]


def cache_key(parts: dict) -> str:
    """`parts`: what the graph depends on (the runner gives model identity, dtype, kernels, threads, shapes);
    with torch's version, kvflow's source and the format added here."""
    whole = {**parts, "torch": torch.__version__, "kvflow_source": kvflow_source_hash(), "format": FORMAT}
    return hashlib.sha256(repr(sorted(whole.items())).encode()).hexdigest()[:32]


def plain_module_state(model: torch.nn.Module) -> dict[str, dict]:
    """Each module's plain bool/int/float/str attributes (kernel choices measured at load, `native` flags...):
    the child copies them onto its own model, so it traces exactly this process's choices."""
    state = {}
    for name, module in model.named_modules():
        attrs = {k: v for k, v in vars(module).items()
                 if not k.startswith("_") and type(v) in (bool, int, float, str)}
        if attrs:
            state[name] = attrs
    return state


class CompiledDecode:
    """`buckets`: the batch sizes; `threads_for(rows)`: the threads a step of that size runs on (baked into its
    graph); `key`: `cache_key`'s parts; `job`: what the child needs to build the same model (see
    compile_worker.py), without `buckets`."""

    def __init__(self, model: torch.nn.Module, buckets: tuple[int, ...], threads_for: Callable[[int], int],
                 key: dict, job: dict):
        self.model = model
        self.buckets = tuple(sorted(buckets))
        self.threads_for = threads_for
        self.ready: set[int] = set()            # loaded: steps of these buckets run compiled
        self.failed = False
        self.compile_seconds: dict[int, float] = {}     # bucket -> seconds the child took (0.0: from the cache)
        self.load_seconds: dict[int, float] = {}        # bucket -> seconds this process took to load it
        self.steps = 0                          # decode steps run compiled
        self.dir = cache_root() / "compiled_decode"
        self.paths = {b: self.dir / f"{cache_key({**key, 'bucket': b, 'threads': threads_for(b)})}.bin"
                      for b in self.buckets}
        self._job = job
        self._graphs: dict[int, Callable] = {}
        self._pending: deque[tuple[int, float]] = deque()   # (bucket, compile seconds) saved by the child
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._watcher: threading.Thread | None = None
        self._stopped = False
        self.compiling = False                  # the child is at work: eager steps leave it a core
        self._finalizer = None

    # ---- the engine thread -------------------------------------------------------------------------
    def bucket_for(self, batch: StepBatch) -> int | None:
        """The compiled bucket that would run this step, or None (eager). Loads graphs the child has saved."""
        if self._pending:
            self.poll()
        if self.failed or batch.num_decodes != len(batch.num_new_tokens):
            return None
        bucket = next((b for b in self.buckets if b >= batch.num_decodes), None)
        return bucket if bucket in self.ready else None

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The compiled forward of the bucket of `ids`' size, or None when it failed (the caller runs the step
        eagerly)."""
        try:
            hidden = self._graphs[len(ids)](self.model, ids, positions, meta)
            self.steps += 1
            return hidden
        except Exception:  # noqa: BLE001 - any failure: serve eagerly from now on
            self._fail("a compiled decode step failed")
            return None

    def poll(self) -> bool:
        """Load every graph the child has saved since the last call (between steps: nothing else runs this
        model meanwhile). True when one was loaded."""
        loaded = False
        with self._lock:
            while self._pending and not self.failed:
                bucket, seconds = self._pending.popleft()
                if self._load(bucket):
                    self.compile_seconds[bucket] = seconds
                    loaded = True
                    log.info("compiled decode steps: %d/%d ready (batch size <= %d: compiled in %.1f s, loaded in "
                             "%.2f s)%s", len(self.ready), len(self.buckets), bucket, seconds,
                             self.load_seconds[bucket], "" if len(self.ready) == len(self.buckets)
                             else ", serving eagerly meanwhile")
        return loaded

    # ---- start-up ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the buckets already in the cache; compile the others in a child process."""
        with self._lock:
            for bucket, path in self.paths.items():
                if path.exists() and self._load(bucket, quiet=True):
                    self.compile_seconds[bucket] = 0.0
            if self.failed:
                return
            missing = [b for b in self.buckets if b not in self.ready]
            if self.ready:
                log.info("compiled decode steps: %d/%d loaded from %s in %.2f s", len(self.ready), len(self.buckets),
                         self.dir, sum(self.load_seconds.values()))
            prune_saved_graphs(self.dir, set(self.paths.values()))
            if not missing:
                return
            log.info("compiling decode steps for batch sizes %s in a background process (low priority): %d/%d ready, "
                     "serving eagerly meanwhile", " ".join(map(str, missing)), len(self.ready), len(self.buckets))
            self._spawn(missing)

    def _spawn(self, missing: list[int]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        job = {**self._job, "buckets": [(b, self.threads_for(b), str(self.paths[b])) for b in missing]}
        self._log_path = self.dir / "compile_worker.log"
        try:
            with open(self._log_path, "ab") as err:
                self._child = subprocess.Popen([sys.executable, "-m", "kvflow.runner.compile_worker"],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
            self._child.stdin.write(pickle.dumps(job))
            self._child.stdin.close()
        except Exception:  # noqa: BLE001
            self._fail("starting the decode-step compiler process failed")
            return
        self.compiling = True
        # the child dies with this process even where shutdown is never called
        self._finalizer = weakref.finalize(self, _kill, self._child)
        self._watcher = threading.Thread(target=self._watch, args=(self._child,), name="kvflow-compile-watch",
                                         daemon=True)
        self._watcher.start()

    def _watch(self, child: subprocess.Popen) -> None:
        """Reads the child's "ready <bucket> <seconds>" lines (this thread only queues them: the engine thread
        loads them). Also imports what loading needs, so the first load does not pause a step for it."""
        try:
            _warm_up_loading()
        except Exception:  # noqa: BLE001 - the load itself will say what is wrong
            pass
        for line in child.stdout:
            words = line.decode(errors="replace").split()
            if len(words) == 3 and words[0] == "ready":
                self._pending.append((int(words[1]), float(words[2])))
        rc = child.wait()
        self.compiling = False
        if rc != 0 and not self._stopped:
            self._fail(f"the decode-step compiler process exited with status {rc} (its log: {self._log_path})",
                       exc_info=False)

    def _load(self, bucket: int, quiet: bool = False) -> bool:
        t = time.perf_counter()
        try:
            os.utime(self.paths[bucket])            # used now: pruning keeps it
        except OSError:
            pass
        try:
            torch._dynamo.config.enable_aot_compile = True
            # guards are rebuilt against the thread-local state: inference mode, as the steps run
            with open(self.paths[bucket], "rb") as f, torch.inference_mode():
                graph = torch.compiler.load_compiled_function(f)
        except Exception:  # noqa: BLE001
            if quiet:               # a cached file that does not load (torch changed under it): compile it again
                log.info("a saved decode graph did not load; compiling it again", exc_info=True)
                self.paths[bucket].unlink(missing_ok=True)
            else:
                self._fail(f"loading the compiled decode step for batch size {bucket} failed")
            return False
        self._graphs[bucket] = graph
        self.load_seconds[bucket] = time.perf_counter() - t
        self.ready.add(bucket)
        return True

    # ---- waiting and stopping ----------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Block until the child is done (or `timeout`), then load what it saved; True when every bucket is
        ready. Call it from the thread that steps the engine (or while no step runs)."""
        if self._watcher is not None:
            self._watcher.join(timeout)
        self.poll()
        return len(self.ready) == len(self.buckets)

    def stop(self) -> None:
        """Compile nothing more: kill the child (a half-written graph is never read: saves are atomic)."""
        self._stopped = True
        self.compiling = False
        if self._child is not None:
            _kill(self._child)
        if self._watcher is not None:
            self._watcher.join(5)

    def _fail(self, what: str, exc_info: bool = True) -> None:
        if not self.failed:
            self.failed = True
            log.warning("%s; every step runs eagerly from now on", what, exc_info=exc_info)


def prune_saved_graphs(folder: Path, keep: set[Path], most: int = MAX_SAVED) -> None:
    """Delete the saved graphs in `folder` beyond the `most` most recently used, never those in `keep`. Another
    process may prune or save at the same time: a file that vanishes meanwhile is fine."""
    def used(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0
    others = sorted((p for p in folder.glob("*.bin") if p not in keep), key=used, reverse=True)
    for p in others[most:]:
        p.unlink(missing_ok=True)


def _kill(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.kill()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _warm_up_loading() -> None:
    """What the first load would otherwise spend ~2 s on: Inductor's modules and its CPU vector-ISA probe."""
    import torch._dynamo.aot_compile  # noqa: F401
    import torch._functorch._aot_autograd.aot_autograd_result  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.lowering  # noqa: F401
    import torch._inductor.select_algorithm  # noqa: F401
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    pick_vec_isa()
