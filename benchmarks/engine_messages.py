"""What a step's messages cost between the frontend and the engine process: one StepResult with 1 or 64
EngineOutputs (one new token each, with and without logprobs) and 64 AddRequests of 500-token prompts, pickled,
sent over a socket pair and unpickled on a reader thread, as `engine_process.py` does. Medians of many rounds.

    python benchmarks/engine_messages.py
"""
from __future__ import annotations

import pickle
import socket
import statistics
import threading
import time
from multiprocessing.connection import Connection

from kvflow.core.messages import AddRequest, StepResult
from kvflow.core.outputs import EngineOutput, StepStats
from kvflow.sampling_params import SamplingParams


def step_result(rows: int, logprobs: bool) -> StepResult:
    outputs = [EngineOutput(f"cmpl-{i:032x}-0", [1234 + i], [{1234 + i: -0.5, 7: -1.5, 9: -2.5}] if logprobs else None,
                            num_prompt_tokens=500) for i in range(rows)]
    return StepResult(outputs, StepStats(num_running=rows, batch_size=rows, num_batched_tokens=rows), 0.0, 0.0, 0, [])


def adds(n: int) -> list[AddRequest]:
    return [AddRequest(f"cmpl-{i:032x}-0", list(range(500)), SamplingParams(max_tokens=64), time.time())
            for i in range(n)]


def round_trip(message, rounds: int = 300) -> tuple[float, int]:
    a, b = socket.socketpair()
    send, recv = Connection(a.detach()), Connection(b.detach())
    got = []

    def reader():
        for _ in range(rounds):
            recv.recv()
            got.append(time.perf_counter())

    t = threading.Thread(target=reader)
    t.start()
    times = []
    for _ in range(rounds):
        n = len(got)
        t0 = time.perf_counter()
        send.send(message)
        while len(got) == n:
            pass
        times.append(got[-1] - t0)
    t.join()
    return statistics.median(times) * 1e6, len(pickle.dumps(message))


def main() -> None:
    print("| message | bytes | send -> received (median µs) |\n| --- | --- | --- |")
    for name, message in [("StepResult, 1 row", step_result(1, False)), ("StepResult, 64 rows", step_result(64, False)),
                          ("StepResult, 64 rows with logprobs", step_result(64, True)),
                          ("64 AddRequests of 500 tokens", adds(64))]:
        us, size = round_trip(message)
        print(f"| {name} | {size:,} | {us:.0f} |")


if __name__ == "__main__":
    main()
