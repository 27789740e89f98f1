"""The typed messages between the frontend (the server process: HTTP, text, the output processor) and the engine
process (EngineCore's step loop, `core/engine_process.py`). Plain picklable dataclasses; nothing else crosses.

    frontend -> engine:  AddRequest, AbortRequests, UtilityCall, Sleep, WakeUp, Shutdown
    engine -> frontend:  EngineReady (once, after the model is loaded), StepResult (one per turn of the loop),
                         UtilityResult (one per UtilityCall, Sleep and WakeUp), EngineDead (the last message of a
                         dying engine)

`AddRequest` is the one record of a request from the frontend to the core, defined beside the core's `Request`
(kvflow/request.py), which is built from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.core.outputs import EngineOutput, StepStats
from kvflow.request import AddRequest

__all__ = ["AddRequest", "AbortRequests", "UtilityCall", "Sleep", "WakeUp", "Shutdown", "EngineReady", "StepResult",
           "UtilityResult", "EngineDead"]


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class UtilityCall:
    """Call one of `EngineCore.UTILITY_METHODS` between steps (checks and counters for tests and tools)."""
    call_id: int
    method: str
    args: tuple = ()


@dataclass(frozen=True)
class Sleep:
    """`EngineCore.sleep(level)` once every unfinished request is done (a drain: none is cut); the messages sent
    after it wait behind it, aborts and utility calls apart. Answered by a UtilityResult with this call id."""
    call_id: int
    level: int


@dataclass(frozen=True)
class WakeUp:
    """`EngineCore.wake_up(tags)` (None: everything asleep); its UtilityResult's value: whether all is awake."""
    call_id: int
    tags: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Shutdown:
    """Stop after the current step (requests still running are the frontend's to fail or drain first)."""


@dataclass(frozen=True)
class EngineReady:
    """What the frontend needs to know of the loaded engine."""
    pid: int
    max_model_len: int
    vocab_size: int
    weights_bytes: int
    kv_cache_bytes: int
    stats: StepStats                  # the gauges before the first step
    num_blocks: int = 0               # KV cache blocks the core hands out (vLLM's num_gpu_blocks)
    num_state_slots: int | None = None   # a hybrid's live recurrent-state slots: requests that can run at once
    tasks: tuple[str, ...] = ("generate", "embed")     # what the model serves (ModelConfig.tasks)
    architecture: str = ""


@dataclass(frozen=True)
class StepResult:
    """Once per turn of the engine loop (a step, or an idle look when something changed)."""
    outputs: list[EngineOutput]
    stats: StepStats
    started: float                    # wall clock of the step's start and end
    finished: float
    num_added: int                    # AddRequests the core took this turn
    rejected: list[tuple[str, str]]   # (core id, why) of adds the core refused


@dataclass(frozen=True)
class UtilityResult:
    call_id: int
    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class EngineDead:
    reason: str
