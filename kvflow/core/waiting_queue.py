"""WaitingQueue: the scheduler's waiting requests, lowest `priority` value first, arrival order within a priority.

vLLM's priority semantics: a lower value runs first; interactive requests are 0, batch work (the Batch API) a
higher value. One FIFO per priority value (there are a handful: 0 and the batch priority, a few more with
`--scheduling-policy priority`), so every operation the scheduler makes per step is O(number of priorities).
A preempted request goes back to the head of its own priority's FIFO (it resumes before later arrivals of its
priority, never before a waiting request of a lower value).
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

from kvflow.request import Request


class WaitingQueue:
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
