"""Rank 0's side of tensor parallelism (the process with the scheduler and the server).

At start it spawns this machine's other ranks, joins the group, and sends every rank its settings. Each
step it sends the step's `StepBatch` over the control group, then runs its own share of the forward and
samples; the other ranks run their shares, and the model's collectives tie the shares together.

Worker death must end the engine, not hang it: a collective with a dead peer fails at once (its connections
close), the group's timeout catches a peer that hangs, a local worker's exit code is checked before every
step, and an idle engine pings the workers (`check_health`) so an idle server notices too. Each of these
raises `TensorParallelError`, which AsyncEngine treats as engine death.
"""
from __future__ import annotations

import logging
import time

import torch

from kvflow import platform
from kvflow.config import EngineConfig
from kvflow.distributed.parallel_state import free_local_port, join_process_group, leave_process_group
from kvflow.executor.worker import (PING, STEP, STOP, Placement, describe_exit, node_placements,
                                    start_local_workers, stop_local_workers)
from kvflow.runner.model_runner import ModelRunner
from kvflow.runner.step import ModelStep, SampledTokens

log = logging.getLogger("kvflow.distributed")


class TensorParallelError(RuntimeError):
    """A worker died, or a collective failed: the ranks are out of step and the engine cannot go on."""


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, model_config, model_path, max_model_len: int):
        self.failed: str | None = None
        self._closed = False
        self.tp = None
        # rank 0 shares this machine's cores with its local workers (ModelRunner sets fewer torch threads);
        # the count is per process, so it is given back at shutdown for engines that run here later
        self._threads_before = torch.get_num_threads()
        self._close_ray = None
        self.workers: list[tuple[Placement, object]] = []
        if config.distributed_executor_backend == "ray":
            # the ranks are Ray actors in a placement group, on whichever nodes Ray puts them (ray_workers.py)
            from kvflow.executor.ray_workers import start_ray_workers

            init_method, first, self.workers, self._close_ray = start_ray_workers(config)
            placements = [first] + [p for p, _w in self.workers]
        else:
            init_method = config.distributed_init_method or f"tcp://127.0.0.1:{free_local_port()}"
            placements = node_placements(config, init_method)
            self.workers = start_local_workers(config, placements[1:])
        try:
            remote = config.tensor_parallel_size - len(placements)
            if self._close_ray is None:        # (ray_workers logs where Ray put each rank)
                log.info("tensor parallel: %d ranks (%d on this machine%s), rendezvous at %s",
                         config.tensor_parallel_size, len(placements),
                         f", {remote} on {config.nnodes - 1} other node(s)" if remote else "", init_method)
            device = platform.pick_device(config.device, 0)
            self.tp = join_process_group(init_method, 0, config.tensor_parallel_size, 0, placements[0].local_size,
                                         device, self.check_alive)
            self.tp.broadcast_from_first((config, max_model_len))
            self.runner = ModelRunner(config, model_config, model_path, max_model_len, tp=self.tp)
        except BaseException as e:
            self.failed = self.failed or f"tensor-parallel start failed: {e}"
            self.shutdown()
            raise

    # ---- liveness ----------------------------------------------------------------------------------
    def _dead_workers(self) -> list[str]:
        return [describe_exit(p, proc) for p, proc in self.workers if proc.exitcode is not None]

    def check_alive(self) -> None:
        """Raise if a local worker has exited (a cheap waitpid per worker)."""
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        dead = self._dead_workers()
        if dead:
            self.failed = "; ".join(dead)
            raise TensorParallelError(self.failed)

    def check_health(self) -> None:
        """Between steps (an idle engine calls this now and then): local exit codes, then a ping that fails
        if any rank, on any machine, has closed its connections."""
        self.check_alive()
        try:
            self.tp.broadcast_from_first((PING, None))
        except Exception as e:
            raise self._failure(e) from e

    def _failure(self, error: Exception) -> TensorParallelError:
        # a collective failed: most likely a worker died; give its exit a moment to show, then say who
        # (a Ray actor's death reaches this process through the cluster: allow it longer)
        deadline = time.monotonic() + (2.0 if self._close_ray is None else 10.0)
        dead = self._dead_workers()
        while not dead and self.workers and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self._dead_workers()
        if dead:      # the collective's own error (connection reset ...) only says that a peer went away
            self.failed = "; ".join(dead)
        else:
            first_line = str(error).splitlines()[0] if str(error) else ""
            self.failed = f"a tensor-parallel step failed: {type(error).__name__}: {first_line}"
        return TensorParallelError(self.failed)

    # ---- steps -------------------------------------------------------------------------------------
    def execute(self, step: ModelStep) -> SampledTokens:
        """Send the step to every rank, run rank 0's share and sample."""
        self.check_alive()
        try:
            self.tp.broadcast_from_first((STEP, step.batch))
            return self.runner.execute(step)
        except Exception as e:
            raise self._failure(e) from e

    # ---- shutdown ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tell every rank to stop, wait for the local workers (terminate stragglers), leave the group."""
        if self._closed:
            return
        self._closed = True
        if self.tp is not None and self.failed is None:
            try:
                self.tp.broadcast_from_first((STOP, None))
            except Exception as e:  # noqa: BLE001 - a broken group: the workers are stopped below anyway
                log.warning("tensor parallel: could not send stop: %s", str(e).splitlines()[0] if str(e) else e)
        stop_local_workers(self.workers, timeout=10.0 if self.failed is None else 1.0)
        if self._close_ray is not None:
            self._close_ray()            # the actors and the placement group
        leave_process_group()
        torch.set_num_threads(self._threads_before)
        log.info("tensor parallel: workers stopped")
