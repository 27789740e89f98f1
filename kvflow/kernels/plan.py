"""The kernel plan: which kernels compute this model here, and how many threads each step takes.

Chosen by the runner before the model is built (`KernelPlan.choose`), so the model's modules take it as they are
built (norms and LoRA terms on kvflow's kernels or torch's: `native_norms`, `native_lora`) and quantization reads
it (`native_matmuls`: weight codes held for kvflow's kernels); completed once the model is loaded with what only the
weights tell (`completed`: how the matrices multiply, the decode step's path), logged at boot as one block, and read
from then on: the runner asks it for every step's threads, the compiled graphs bake its thread counts in, and the
tests of "the default engine" read it to know which path this machine takes. Each choice is made in one place:
- whether kvflow's own kernels run here at all, and their vector ISA: `build.wanted` / `build.isa`, asked here;
- attention and norms on kvflow's kernels, the small-step thread pool, and threads per step: here;
- the weight matrices' kernels by format and step size: `quantize_model` (layers/quantization.py, with
  layers/int4.py for torch's int4 kernel, whose crossover is measured on the weights), kept as `matmuls`;
- the decode step as one native call: `NativeDecoderStep.build` (runner/native_step.py) says whether it computes
  this model; else compiled graphs where the runner compiles them, else the model's layers one by one.
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

from kvflow.kernels import build, ops

SMALL_STEP_ROWS = 8      # EngineConfig.small_step_threads applies to steps of up to this many rows (and kvflow's
                         # kernels run calls of up to this many rows on their own pool: csrc/common.h's POOL_ROWS)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    device: torch.device
    isa: str | None               # kvflow's kernels' vector ISA here ("avx512": VNNI; "avx2"); None: off
    matmuls: str                  # how the weight matrices multiply, by format and step size
    native_attention: bool        # attention and norms on kvflow's kernels; else SDPA over the gathered context
    kernel_pool: bool             # every matmul, attention and norm on kvflow's kernels: small steps on its pool
    decode_step: str              # "native", "compiled" or "layers"
    why_not_native_step: str      # "" where the step is one native call
    threads: int                  # this process's cores for the model (platform.setup_threads)
    small_step_threads: int | None
    frontend_shares_cores: bool   # an engine process beside its HTTP frontend (platform.frontend_shares_cores)
    sliding_window: str = ""      # the sliding-window layers, for the log ("" for none)
    dtype: torch.dtype = torch.float32      # the compute dtype

    @classmethod
    def choose(cls, device: torch.device, dtype: torch.dtype, quantization: str | None, head_dim: int,
               kv_dtype: torch.dtype, heads_per_kv_head: int, threads: int, small_step_threads: int | None,
               frontend_shares_cores: bool) -> KernelPlan:
        """Every choice that needs no weights, before the model is built; `completed` adds the rest after load."""
        native = build.wanted(device, dtype, quantization) and build.library() is not None
        # kvflow's paged-attention kernel (and its norms) where its linear kernels run: faster than gathering the
        # context for SDPA, and each row's result depends on that row alone (batch invariance; csrc/attention.c)
        native_attention = native and ops.attention_supports(head_dim, kv_dtype, heads_per_kv_head)
        return cls(device=device, isa=build.isa() if native else None, matmuls="", native_attention=native_attention,
                   # every matmul, attention and norm of a step is kvflow's (weight codes on its kernels): small steps
                   # run them on kvflow's thread pool (step_threads)
                   kernel_pool=native_attention and quantization in ("gguf", "int4"), decode_step="layers",
                   why_not_native_step="", threads=threads, small_step_threads=small_step_threads,
                   frontend_shares_cores=frontend_shares_cores, dtype=dtype)

    def completed(self, matmuls: str, decode_step: str, why_not_native_step: str, sliding_window: str) -> KernelPlan:
        """The plan with what the loaded model told: how its matrices multiply, its decode step's path."""
        return dataclasses.replace(self, matmuls=matmuls, decode_step=decode_step,
                                   why_not_native_step=why_not_native_step, sliding_window=sliding_window)

    @property
    def native_matmuls(self) -> bool:
        """kvflow's kernels multiply the weight codes they hold (kernels/formats.py) wherever the format allows."""
        return self.isa is not None

    @property
    def native_norms(self) -> bool:
        """RMSNorm on kvflow's kernel (with attention: the same condition), and LoRA terms batch invariant."""
        return self.native_attention

    @property
    def native_lora(self) -> bool:
        """LoRA terms on kvflow's kernel (each row its own slot), which computes float32."""
        return self.native_attention and self.dtype == torch.float32

    @property
    def yields_cores(self) -> bool:
        """Whether steps take only the cores other processes leave (`CoreShare`): on a CPU where every matmul,
        attention and norm is kvflow's, whose bits do not depend on the thread count. torch's float32 matmuls may
        round otherwise on another count, and then an answer would depend on what else ran on the machine."""
        return self.device.type == "cpu" and self.kernel_pool

    def step_threads(self, rows: int, cores: int | None = None) -> tuple[int, int]:
        """(torch's threads, kvflow's kernels' threads) for a step of `rows` rows, at most `cores` each (the cores
        that other processes leave this one: `CoreShare`; None: all of them). A small step is ~200 short kernel
        calls. On kvflow's pool (csrc/thread_pool.c; `kernel_pool`) its kernels take every core, or
        `small_step_threads`: a preempted thread delays nobody there, so the frontend and other processes cost a
        share of a core, not a time slice per call; torch's own ops in such a step are tiny (adds, activations) and
        run on one thread, since each of their OpenMP regions waits for all of its threads. Without the pool, small
        steps take `small_step_threads`, or in a server every core but one for the frontend (measured on 2-core
        Zen 5, embedded model in Q4_0, one stream, eager, OpenMP: TPOT 13.0 ms on one thread, 12.3-85 ms on two,
        375 ms on two beside a busy process). Bigger steps, and every step off the CPU: every thread for both."""
        if self.device.type != "cpu":
            return self.threads, self.threads
        most = min(self.threads, cores or self.threads)
        if rows > SMALL_STEP_ROWS:
            return most, most
        if self.kernel_pool:
            return 1, min(self.small_step_threads or most, most)
        if self.small_step_threads:
            small = min(self.small_step_threads, most)
        else:
            small = max(1, most - 1) if self.frontend_shares_cores else most
        return small, small

    def describe(self) -> str:
        """The boot log's block."""
        isa = {"avx512": "AVX-512 VNNI", "avx2": "AVX2"}.get(self.isa or "", self.isa)
        kernels = f"kvflow's {isa} kernels" if self.isa else "no kvflow kernels"
        attention = ("kvflow's paged-attention kernel and norms" if self.native_attention
                     else "SDPA over the gathered context")
        step = {"native": "one native call each (runner/native_step.py)",
                "compiled": "compiled graphs per batch size, layer by layer until each is ready",
                "layers": "layer by layer"}[self.decode_step]
        if self.why_not_native_step and self.kernel_pool:
            step += f" (the native step does not run here: {self.why_not_native_step})"
        small, large = self.step_threads(1), self.step_threads(SMALL_STEP_ROWS + 1)
        pool = " (its thread pool)" if self.kernel_pool else ""
        lines = [f"kernel plan: {self.device}, {kernels}, {self.threads} thread(s)",
                 f"  matmuls: {self.matmuls}",
                 f"  attention: {attention}{self.sliding_window}",
                 f"  decode steps: {step}",
                 f"  threads: steps of <= {SMALL_STEP_ROWS} rows {small[0]} for torch's ops and {small[1]} for "
                 f"kvflow's kernels{pool}; larger steps {large[0]} and {large[1]}"
                 + ("; fewer while other processes keep cores busy (CoreShare)" if self.yields_cores else "")]
        return "\n".join(lines)


class CoreShare:
    """How many of the machine's cores (those this process may run on) the rest of the machine leaves it: measured
    from the kernel's CPU counters (/proc/stat less this process's own time, and its HTTP frontend's) at most once
    per `INTERVAL` seconds, read at every step.

    Why: time on a core is shared fairly among the threads that want it. Beside a process that keeps one of two
    cores busy, a step on two threads gets two thirds of a core per thread, and every OpenMP region of a big step
    (a prefill) waits at its barrier for whichever thread the OS preempted; on one thread the step has a core of
    its own. Measured on a 2-core Intel Xeon (embedded model, one stream, `benchmarks/serve_compare.py
    --co-tenant`): TPOT 11.2 ms and TTFT p95 945 ms on two threads beside the busy process, 9.3 ms and 39 ms on
    one; alone, two threads (6.1 ms) beat one (8.5 ms). So a step takes the cores left over, rounded: a load
    generator or another light process beside it (well under half a core) leaves both. Only where the plan
    `yields_cores`: kvflow's kernels give the same bits on any thread count, so output does not depend on it."""

    INTERVAL = 1.0

    def __init__(self, frontend_pid: int | None = None):
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.frontend_pid = frontend_pid
        self.free = self.cores
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._last: tuple[float, int, int] | None = None

    def __call__(self) -> int:
        now = time.monotonic()
        if self._last is None or now - self._last[0] >= self.INTERVAL:
            self._measure(now)
        return self.free

    def _measure(self, now: float) -> None:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()        # "cpu user nice system idle iowait irq softirq steal ..."
            busy = sum(int(v) for i, v in enumerate(fields[1:9]) if i not in (3, 4))
            mine = _process_ticks(os.getpid()) + (_process_ticks(self.frontend_pid) if self.frontend_pid else 0)
        except (OSError, ValueError, IndexError):    # no /proc (not Linux): every core
            self.free, self._last = self.cores, (now, 0, 0)
            return
        if self._last is not None and self._last[1]:
            seconds = now - self._last[0]
            others = ((busy - self._last[1]) - (mine - self._last[2])) / self._ticks / seconds
            self.free = max(1, min(self.cores, int(self.cores - others + 0.5)))
        self._last = (now, busy, mine)


def _process_ticks(pid: int) -> int:
    """utime + stime of every thread of `pid`, in clock ticks (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        after_name = f.read().rsplit(")", 1)[1].split()
    return int(after_name[11]) + int(after_name[12])
