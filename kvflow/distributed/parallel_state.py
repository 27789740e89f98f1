"""One rank's place in the tensor-parallel group, how sizes are split over ranks, and the collectives.

Two process groups exist while tensor parallelism runs:
- the default group (gloo on CPU, NCCL on CUDA) carries the model's collectives: the all-reduce after
  o_proj, down_proj and the embedding, the gather of the LM head's vocabulary slices. Its timeout is the
  last resort against a peer that hangs (a peer that dies closes its connections and fails the collective
  at once);
- the control group (always gloo: step descriptions are Python objects on the CPU) carries rank 0's
  messages to the workers. A worker waits on it for as long as the server is idle, so its timeout is long.
"""
from __future__ import annotations

import datetime
import socket
import time
from typing import Callable

import torch
import torch.distributed as dist

from kvflow.config import parse_init_method

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
CONTROL_TIMEOUT = datetime.timedelta(days=30)     # an idle server sends nothing; workers wait for it
JOIN_TIMEOUT_S = 600.0                           # every rank (other machines too) must join within this


def even_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """Split range(n) into `parts` contiguous [start, end) ranges whose sizes differ by at most one
    (the first ranges get the extra items)."""
    base, extra = divmod(n, parts)
    bounds = [i * base + min(i, extra) for i in range(parts + 1)]
    return list(zip(bounds, bounds[1:]))


class TensorParallel:
    """This process's rank in the tensor-parallel group, and the collectives the model calls. At size 1
    (the default) every collective is a no-op and nothing touches torch.distributed."""

    def __init__(self, rank: int = 0, size: int = 1, local_rank: int = 0, local_size: int = 1,
                 control_group=None):
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size   # place among the ranks of this machine
        self.control_group = control_group

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size})"

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> tuple[int, int]:
        """This rank's contiguous [start, end) share of n items (heads, columns, vocabulary rows)."""
        return even_ranges(n, self.size)[self.rank]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (each rank holds a partial sum of a row-parallel layer)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor, total: int) -> torch.Tensor | None:
        """Concatenate every rank's [rows, own share of `total`] slice along the last dim, in rank order,
        on rank 0; the other ranks get None. Shares may differ by one: they are padded to the largest."""
        if self.size == 1:
            return x
        ranges = even_ranges(total, self.size)
        width = ranges[0][1] - ranges[0][0]
        padded = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        pieces = [torch.empty_like(padded) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(padded.contiguous(), pieces, dst=0)
        if self.rank != 0:
            return None
        return torch.cat([p[..., :end - start] for p, (start, end) in zip(pieces, ranges)], dim=-1)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (each rank's KV cache budget in blocks: all must agree)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def broadcast_from_first(self, obj=None):
        """Rank 0 sends a picklable object over the control group; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]


def join_process_group(init_method: str, rank: int, size: int, local_rank: int, local_size: int,
                       device: torch.device, check_local_workers: Callable[[], None] | None = None
                       ) -> TensorParallel:
    """Join the tensor-parallel group as `rank` of `size`. Rank 0 hosts the rendezvous store at HOST:PORT.

    Every rank first announces itself in the store and waits until all have (other machines may start
    minutes later), calling `check_local_workers` meanwhile: a local worker that dies at startup is an error
    at once, not a wait for a timeout. Only then is the process group (with its short timeout) created."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a tensor-parallel group: one tensor-parallel "
                           "engine per process")
    host, port = parse_init_method(init_method)
    store = dist.TCPStore(host, port, size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False)
    store.set(f"kvflow/joined/{rank}", "1")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    keys = [f"kvflow/joined/{r}" for r in range(size)]
    while not store.check(keys):
        if check_local_workers is not None:
            check_local_workers()
        if time.monotonic() > deadline:
            missing = [r for r in range(size) if not store.check([keys[r]])]
            raise TimeoutError(f"tensor-parallel ranks {missing} did not join {init_method} "
                               f"within {JOIN_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
                            **kwargs)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(rank, size, local_rank, local_size, control)


def free_local_port() -> int:
    """A free TCP port on 127.0.0.1 for a one-machine rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
