"""The scheduler's waiting queue, one class per `--scheduling-policy`, made by `create_request_queue` (vLLM's name).

`WaitingQueue`: lowest `priority` value first, arrival order within a priority. vLLM's priority semantics: a lower
value runs first; interactive requests are 0, batch work (the Batch API) a higher value. One FIFO per priority value
(there are a handful: 0 and the batch priority, a few more with `--scheduling-policy priority`), so every operation
the scheduler makes per step is O(number of priorities). A preempted request goes back to the head of its own
priority's FIFO (it resumes before later arrivals of its priority, never before a waiting request of a lower value).

A policy is the order its queue gives requests out in and when it lets them go: `admits(running)` (may anyone be
admitted this step) and `admits_whole_prompts` (admit a prompt whole, its blocks reserved at once, beyond the step's
prompt budget, or just the chunk that fits). The scheduler asks these and has no branch per policy.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator, Sequence

from kvflow.request import Request


class WaitingQueue:
    """continuous, fcfs and priority: continuous batching, lowest value first. The three differ only in whether a
    request may set its own value (the server refuses one but under `priority`); the Batch API's lines run at
    `--batch-priority` under each."""

    admits_whole_prompts = False     # see StaticBatchQueue

    def __init__(self) -> None:
        self._fifos: dict[int, deque[Request]] = {}
        self._order: list[int] = []       # the priorities with a non-empty FIFO, ascending
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for p in self._order:
            yield from self._fifos[p]

    def __contains__(self, req: Request) -> bool:
        fifo = self._fifos.get(req.priority)
        return fifo is not None and req in fifo

    def _fifo(self, priority: int) -> deque[Request]:
        fifo = self._fifos.get(priority)
        if fifo is None:
            fifo = self._fifos[priority] = deque()
        if not fifo:
            self._order.append(priority)
            self._order.sort()
        return fifo

    def append(self, req: Request) -> None:
        self._fifo(req.priority).append(req)
        self._len += 1

    def appendleft(self, req: Request) -> None:
        self._fifo(req.priority).appendleft(req)
        self._len += 1

    def peek(self) -> Request:
        """The request that runs next: the oldest of the lowest priority value."""
        return self._fifos[self._order[0]][0]

    def popleft(self) -> Request:
        p = self._order[0]
        fifo = self._fifos[p]
        req = fifo.popleft()
        if not fifo:
            self._order.pop(0)
        self._len -= 1
        return req

    def remove(self, req: Request) -> None:
        fifo = self._fifos[req.priority]
        fifo.remove(req)
        if not fifo:
            self._order.remove(req.priority)
        self._len -= 1

    # ---- the policy ------------------------------------------------------------------------------------------------
    def admits(self, running: Sequence[Request]) -> bool:
        """Whether waiting requests may be admitted this step, the running ones scheduled (`running`: in the
        scheduler's order)."""
        return True


class StaticBatchQueue(WaitingQueue):
    """static (for A/B benchmarks against continuous batching): a batch forms while none of its requests has produced
    a token (requests arriving during its prefill steps join it), then admits nothing until the whole batch has
    finished. Each admitted prompt's blocks are reserved at once, and its prefill runs over the next steps."""

    admits_whole_prompts = True

    def admits(self, running: Sequence[Request]) -> bool:
        return not any(r.num_output_tokens > 0 for r in running)


# every --scheduling-policy (config.SCHEDULING_POLICIES) and its queue
REQUEST_QUEUES: dict[str, type[WaitingQueue]] = {
    "continuous": WaitingQueue, "fcfs": WaitingQueue, "priority": WaitingQueue, "static": StaticBatchQueue,
}


def create_request_queue(policy: str) -> WaitingQueue:
    """The waiting queue of `--scheduling-policy` `policy` (a name EngineConfig.validate has checked)."""
    return REQUEST_QUEUES[policy]()
