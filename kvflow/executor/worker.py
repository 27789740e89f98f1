"""Tensor-parallel workers: the ranks other than 0. A worker joins the group, builds its ModelRunner (its
share of the weights and of the KV cache), then runs the forward of every step rank 0 sends until it is
told to stop. It never schedules or samples: the step description carries the input ids.

Local workers are spawned ('spawn' start method: a fresh interpreter, no forked threads or CUDA state). A
node other than 0 (`kvflow serve --node-rank K`) runs its first rank in its own process and spawns the rest.
"""
from __future__ import annotations

import logging
import multiprocessing
import sys
from dataclasses import dataclass

from kvflow import platform
from kvflow.config import EngineConfig
from kvflow.distributed.parallel_state import join_process_group, leave_process_group

log = logging.getLogger("kvflow.distributed")

# rank 0's messages on the control group: (kind, payload)
STEP, PING, STOP = "step", "ping", "stop"


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: its global rank, its index among the ranks of its machine, the rendezvous."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    init_method: str


def node_placements(config: EngineConfig, init_method: str) -> list[Placement]:
    """The ranks of this node (config.node_rank): tensor_parallel_size // nnodes consecutive ones."""
    per_node = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * per_node
    return [Placement(first + i, config.tensor_parallel_size, i, per_node, init_method) for i in range(per_node)]


def run_worker(config: EngineConfig, placement: Placement, check_local_workers=None) -> None:
    """One rank > 0, in the calling process, until rank 0 says stop (returns) or the group breaks (raises)."""
    from kvflow.models.model_files import resolve_model_files
    from kvflow.runner.model_runner import ModelRunner

    device = platform.pick_device(config.device, placement.local_rank)
    tp = join_process_group(placement.init_method, placement.rank, placement.size, placement.local_rank,
                            placement.local_size, device, check_local_workers)
    try:
        # rank 0's settings, not this node's command line: every rank must build the same model and cache
        config, max_model_len = tp.broadcast_from_first()
        files = resolve_model_files(config.model, hf_overrides=config.hf_overrides)
        runner = ModelRunner(config, files.config, files, max_model_len, tp=tp)
        log.info("rank %d of %d ready: %d of %d KV heads, %d KV blocks", tp.rank, tp.size,
                 runner.model.sizes.num_kv_heads, runner.model_config.num_key_value_heads, runner.num_blocks)
        while True:
            kind, payload = tp.broadcast_from_first()
            if kind == STEP:
                runner.forward(payload)
            elif kind == STOP:
                log.info("rank %d: stop", tp.rank)
                return
    finally:
        leave_process_group()


def _worker_process_main(config: EngineConfig, placement: Placement, log_level: int) -> None:
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [rank {placement.rank}]: %(message)s")
    logging.getLogger("kvflow").setLevel(log_level)
    try:
        run_worker(config, placement)
    except BaseException as e:  # noqa: BLE001 - a worker reports any death and exits non-zero
        log.error("rank %d failed: %s: %s", placement.rank, type(e).__name__, e)
        sys.exit(1)


def start_local_workers(config: EngineConfig, placements: list[Placement]) -> list[tuple[Placement, multiprocessing.Process]]:
    """Spawn one process per placement. Daemonic: a parent that exits without shutting them down takes them along."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    level = logging.getLogger("kvflow").getEffectiveLevel()
    started = []
    for placement in placements:
        proc = ctx.Process(target=_worker_process_main, args=(config, placement, level),
                           name=f"kvflow-tp-rank{placement.rank}", daemon=True)
        proc.start()
        log.info("tensor-parallel rank %d of %d: worker pid %d", placement.rank, placement.size, proc.pid)
        started.append((placement, proc))
    return started


def describe_exit(placement: Placement, proc: multiprocessing.Process) -> str:
    code = proc.exitcode
    how = f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
    if getattr(proc, "died", None):          # a Ray actor (ray_workers.RayWorker): Ray's own reason
        how = f"its Ray actor died: {proc.died}"
    return f"tensor-parallel worker rank {placement.rank} (pid {proc.pid}) died ({how})"


def stop_local_workers(procs: list[tuple[Placement, multiprocessing.Process]], timeout: float = 10.0) -> None:
    """Wait for workers told to stop; terminate (then kill) those that do not exit in time."""
    for _placement, proc in procs:
        proc.join(timeout)
        if proc.exitcode is None:
            proc.terminate()
            proc.join(5)
        if proc.exitcode is None:
            proc.kill()
            proc.join(5)


def run_worker_node(config: EngineConfig) -> int:
    """`kvflow serve --node-rank K` (K > 0): this machine's ranks only, no HTTP server. Returns the exit code."""
    placements = node_placements(config, config.distributed_init_method)
    log.info("node %d of %d: tensor-parallel ranks %d-%d of %d, rendezvous at %s; no HTTP server on this node "
             "(node 0 serves); exits when rank 0 shuts down", config.node_rank, config.nnodes,
             placements[0].rank, placements[-1].rank, config.tensor_parallel_size, config.distributed_init_method)
    procs = start_local_workers(config, placements[1:])

    def check_local_workers():
        for placement, proc in procs:
            if proc.exitcode is not None:
                raise RuntimeError(describe_exit(placement, proc))

    code = 0
    try:
        run_worker(config, placements[0], check_local_workers)
    except Exception as e:
        log.error("rank %d failed: %s: %s", placements[0].rank, type(e).__name__, e)
        code = 1
    finally:
        stop_local_workers(procs, timeout=30.0 if code == 0 else 2.0)
    if any(proc.exitcode != 0 for _, proc in procs):
        code = 1
    log.info("node %d: done (exit %d)", config.node_rank, code)
    return code
