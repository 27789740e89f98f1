"""Tensor-parallel workers as Ray actors (`distributed_executor_backend="ray"`), as vLLM places its workers.

Rank 0 stays in the engine process, as with `mp`; ranks 1..N-1 are Ray actors, one per bundle of a placement
group of N bundles of one CPU each. Bundle 0 is pinned to the engine's node and reserves rank 0's CPU, so
`STRICT_PACK` (the default) puts every rank on the engine's machine and `SPREAD` (environment
`VLLM_RAY_PG_STRATEGY`, vLLM's name; also `PACK`, `STRICT_SPREAD`) lets Ray place them over the cluster's nodes:
no `--nnodes` / `--node-rank` by hand. Each actor runs `worker.run_worker` (the same rank loop as a spawned
worker) with a rendezvous at the engine node's address; the collectives are the same gloo groups.

`RayWorker` answers what the executor asks of a `multiprocessing.Process` (pid, exitcode, is_alive, join,
terminate, kill), so `TensorParallelExecutor` watches both kinds alike: an actor that dies (SIGKILL, its node lost)
is never restarted (a new rank cannot join a running group) and ends the engine with the same
`TensorParallelError` naming the rank.
"""
from __future__ import annotations

import logging
import os
import socket
import sys

from kvflow.config import EngineConfig
from kvflow.executor.worker import Placement, run_worker

log = logging.getLogger("kvflow.distributed")

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
STRATEGY_ENV = "VLLM_RAY_PG_STRATEGY"
PG_TIMEOUT_ENV = "VLLM_RAY_PG_TIMEOUT_S"
DEFAULT_PG_TIMEOUT_S = 120.0


def placement_strategy() -> str:
    strategy = os.environ.get(STRATEGY_ENV, "STRICT_PACK").upper()
    if strategy not in STRATEGIES:
        raise ValueError(f"{STRATEGY_ENV} must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    return strategy


class _RankActor:
    """One rank > 0 in a Ray worker process (wrapped by `ray.remote` when the executor starts)."""

    def pid(self) -> int:
        return os.getpid()

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def run(self, config: EngineConfig, placement: Placement, log_level: int) -> None:
        logging.basicConfig(level=log_level, stream=sys.stderr, force=True,
                            format=f"%(asctime)s %(levelname)s %(name)s [rank {placement.rank}]: %(message)s")
        logging.getLogger("kvflow").setLevel(log_level)
        try:
            run_worker(config, placement)
        except BaseException as e:
            log.error("rank %d failed: %s: %s", placement.rank, type(e).__name__, e)
            raise


class RayWorker:
    """A rank's actor, seen as a process: `exitcode` None while it runs, 0 once it returned after STOP, 1 if it
    raised, and `died` (Ray's reason) when its process went away."""

    def __init__(self, ray, actor, placement: Placement, pid: int) -> None:
        self._ray = ray
        self.actor = actor
        self.placement = placement
        self.pid = pid
        self.name = f"kvflow-tp-rank{placement.rank}"
        self.ref = None
        self.died: str | None = None
        self.node_id: str | None = None        # the Ray node its bundle is on
        self._exitcode: int | None = None

    def start(self, config: EngineConfig, log_level: int) -> None:
        self.ref = self.actor.run.remote(config, self.placement, log_level)

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None and self.ref is not None:
            ready, _ = self._ray.wait([self.ref], timeout=0)
            if ready:
                self._settle()
        return self._exitcode

    def _settle(self) -> None:
        from ray.exceptions import RayActorError

        try:
            self._ray.get(self.ref)
            self._exitcode = 0
        except RayActorError as e:
            self.died = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self._exitcode = -9       # its process is gone: a signal, a crash, its node lost
        except Exception:  # noqa: BLE001 - the rank raised (logged by the actor)
            self._exitcode = 1

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self._exitcode is None and self.ref is not None:
            ready, _ = self._ray.wait([self.ref], timeout=timeout)
            if ready:
                self._settle()

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if self._exitcode is None:
            self._exitcode = -9
            self.died = self.died or "killed at shutdown"


def start_ray_workers(config: EngineConfig) -> tuple[str, Placement, list[tuple[Placement, RayWorker]], object]:
    """Connect to the Ray cluster (Ray's default: RAY_ADDRESS, else a cluster on this machine, else a new local one),
    reserve the placement group, start ranks 1..N-1. Returns (the rendezvous, rank 0's placement, the workers,
    a closer that frees the actors and the group)."""
    try:
        import ray
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError as e:
        raise ImportError(f"distributed_executor_backend=ray needs Ray: pip install 'kvflow[ray]' ({e})") from e

    strategy = placement_strategy()
    size = config.tensor_parallel_size
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level=logging.WARNING, log_to_driver=True)
    here = ray.util.get_node_ip_address()
    # bundle 0 is rank 0's (this process, not an actor): on this node, so that STRICT_PACK means this machine
    bundles = [{"CPU": 1.0, f"node:{here}": 0.001}] + [{"CPU": 1.0} for _ in range(size - 1)]
    pg = placement_group(bundles, strategy=strategy, name=f"kvflow-tp-{os.getpid()}")
    workers: list[tuple[Placement, RayWorker]] = []

    def close() -> None:
        for _placement, worker in workers:
            worker.kill()
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - the cluster may be gone
            pass
        if started_ray:
            ray.shutdown()

    try:
        timeout = float(os.environ.get(PG_TIMEOUT_ENV, DEFAULT_PG_TIMEOUT_S))
        ready, _ = ray.wait([pg.ready()], timeout=timeout)
        if not ready:
            raise TimeoutError(
                f"the Ray cluster could not place {size} bundles of 1 CPU with strategy {strategy} within "
                f"{timeout:.0f} s (resources now: {ray.available_resources()}); STRICT_PACK needs {size} CPUs on "
                f"this node: set {STRATEGY_ENV}=SPREAD to use other nodes")
        nodes = placement_group_table(pg)["bundles_to_node_id"]          # bundle index -> node id
        per_node: dict[str, list[int]] = {}
        for index in range(size):
            per_node.setdefault(nodes[index], []).append(index)
        port = _free_port(here)
        init_method = f"tcp://{here}:{port}"
        placements = [Placement(rank, size, per_node[nodes[rank]].index(rank), len(per_node[nodes[rank]]),
                                init_method) for rank in range(size)]
        actor_class = ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0)(_RankActor)
        level = logging.getLogger("kvflow").getEffectiveLevel()
        for placement in placements[1:]:
            actor = actor_class.options(
                name=f"kvflow-tp-rank{placement.rank}-{os.getpid()}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=placement.rank),
            ).remote()
            workers.append((placement, RayWorker(ray, actor, placement, 0)))
        pids = ray.get([w.actor.pid.remote() for _p, w in workers], timeout=timeout)
        for (placement, worker), pid in zip(workers, pids):
            worker.pid = pid
            worker.node_id = nodes[placement.rank]
            worker.start(config, level)
            log.info("tensor-parallel rank %d of %d: Ray actor pid %d on node %s", placement.rank, size, pid,
                     nodes[placement.rank][:12])
        log.info("tensor parallel over Ray: %d ranks on %d node(s), placement group %s, rendezvous at %s",
                 size, len(per_node), strategy, init_method)
        return init_method, placements[0], workers, close
    except BaseException:
        close()
        raise


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

