"""AsyncEngine: one engine thread runs EngineCore's step loop; asyncio code submits requests and reads
per-request streams.

Threads and who touches what:
- the engine thread is the only caller of `core.add_request / abort / step / stats`. It sleeps on a
  condition variable while there is nothing to do, drains the inbox (adds and aborts) before every step,
  and hands each step's outputs to the event loop with one `loop.call_soon_threadsafe` per step;
- the asyncio side (the server) tokenizes, submits, detokenizes (incrementally, with stop strings) and
  observes per-request metrics. A stop-string hit or a client that goes away aborts the request in the core.

`n > 1` fans out into child requests `f"{request_id}-{i}"` (seed + i when a seed is given).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from kvflow.core.outputs import EngineOutput
from kvflow.metrics import EngineMetrics, FinishedRequest, RequestTimings
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger("kvflow.async_engine")

# An idle engine thread wakes this often to ask the core whether it can still step (a tensor-parallel worker
# may have died while nothing ran): an idle server notices, reports unhealthy and can exit.
HEALTH_CHECK_INTERVAL_S = 1.0


class RequestFailedError(RuntimeError):
    """The engine could not finish this request."""


class EngineDeadError(RequestFailedError):
    """The engine loop died: nothing more will come out of it."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (`--max-queue-len`): try again later."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


@dataclass
class CompletionDelta:
    """What one step added to one choice of a request, as text and tokens."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Choice:
    index: int
    core_id: str
    timings: RequestTimings
    detokenizer: object | None = None
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""                      # accumulated (kept for non-streamed responses and tests)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestStream:
    """The asyncio side of one request (all of its `n` choices). Iterate it for `CompletionDelta`s."""

    def __init__(self, engine: "AsyncEngine", request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.loop = loop
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.error: str | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[_Choice] = []
        self._closed = False

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    # called on the event loop by the engine's dispatcher
    def _put(self, item) -> None:
        self.queue.put_nowait(item)

    def _fail(self, message: str) -> None:
        self.queue.put_nowait(("error", None, message))

    def __aiter__(self) -> AsyncIterator[CompletionDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[CompletionDelta]:
        try:
            while not self.finished:
                kind, index, payload = await self.queue.get()
                if kind == "error":
                    self.error = payload
                    raise (EngineDeadError if self.engine._dead else RequestFailedError)(payload)
                choice = self.choices[index]
                if choice.finished:
                    continue
                delta = self._process(choice, payload)
                if delta is not None:
                    yield delta
        finally:
            self.close()

    def _process(self, choice: _Choice, item) -> CompletionDelta | None:
        out: EngineOutput
        out, times = item
        t_step_start, t_done = times
        t = choice.timings
        if out.num_prompt_tokens:
            self.num_prompt_tokens = out.num_prompt_tokens
        if choice.index == 0 and (out.num_cached_tokens or choice.num_tokens == 0):
            self.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason == "error":
            self.error = str(out.stop_reason or "the engine failed on this request")
            raise RequestFailedError(self.error)
        new_ids = list(out.new_token_ids)
        if new_ids:
            if t.first_token is None:
                t.first_token = t_done
                if t.scheduled is None:
                    t.scheduled = t_step_start
            t.last_token = t_done
            t.token_times.extend([t_done] * len(new_ids))
            choice.num_tokens += len(new_ids)
        text = ""
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        detok = choice.detokenizer
        if detok is not None:
            if new_ids:
                text = detok.add(new_ids)
            if getattr(detok, "stop_str", None) is not None and finish_reason is None:
                # a stop string matched: end this choice here and free its KV blocks in the core
                finish_reason, stop_reason = "stop", detok.stop_str
                self.engine._abort_core([choice.core_id])
            elif finish_reason is not None and getattr(detok, "stop_str", None) is None:
                text += detok.flush()
            elif finish_reason is not None:
                finish_reason, stop_reason = "stop", detok.stop_str
        choice.text += text
        if finish_reason is not None:
            choice.finish_reason, choice.stop_reason = finish_reason, stop_reason
            t.finished = t_done
            self.engine._unroute(choice.core_id)
        if not text and not new_ids and finish_reason is None:
            return None
        return CompletionDelta(choice.index, text, new_ids, out.new_logprobs, finish_reason, stop_reason)

    def close(self) -> None:
        """Abort whatever is unfinished (client went away, consumer stopped) and record the request."""
        if self._closed:
            return
        self._closed = True
        now = time.time()
        unfinished = [c for c in self.choices if not c.finished]
        if unfinished:
            self.engine._abort_core([c.core_id for c in unfinished])
            for c in unfinished:
                c.finish_reason = "error" if self.error else "abort"
                c.timings.finished = now
                self.engine._unroute(c.core_id)
        self.engine._request_done(self)

    async def abort(self) -> None:
        self.close()


class AsyncEngine:
    """Runs `EngineCore` on its own thread and serves asyncio callers."""

    def __init__(self, core, tokenizer=None, *, served_model_name: str | None = None,
                 max_queue_len: int | None = None, metrics: EngineMetrics | None = None,
                 log_stats_interval: float = 5.0) -> None:
        self.core = core
        self.tokenizer = tokenizer
        config = getattr(core, "config", None)
        self.served_model_name = served_model_name or (getattr(config, "served_model_name", None)
                                                       or str(getattr(core, "model_path", "kvflow")))
        self.max_model_len: int = int(core.max_model_len)
        self.max_queue_len = max_queue_len
        self.metrics = metrics or EngineMetrics(
            self.served_model_name, max_model_len=self.max_model_len,
            max_num_seqs=getattr(config, "max_num_seqs", 128),
            max_num_batched_tokens=getattr(config, "max_num_batched_tokens", 1024),
            log_stats_interval=log_stats_interval)

        self._cond = threading.Condition()
        self._inbox: collections.deque = collections.deque()    # ("add", ...) / ("abort", [ids])
        self._pending_adds = 0      # submitted, not yet counted by a stats snapshot (guarded by _cond)
        self._core_waiting = 0      # num_waiting of the last snapshot
        self._stop = False
        self._accepting = True
        self._dead: str | None = None
        self._streams: dict[str, RequestStream] = {}            # parent id -> stream (event loop side)
        self._routes: dict[str, tuple[RequestStream, int]] = {}  # core id -> (stream, choice index)
        self._live_core_ids: set[str] = set()                   # engine thread only
        self._unscheduled: dict[str, RequestTimings] = {}        # engine thread only: added, not yet computed
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.last_stats: dict = {}
        self.num_steps = 0
        self.max_batch_size = 0
        # called once, on the engine thread, after the engine died and its requests were failed
        # (`kvflow serve` sets it to stop the server, which then exits non-zero)
        self.on_death = None

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config, *, max_queue_len: int | None = None, request_log: str | None = None,
                    log_stats_interval: float = 5.0) -> "AsyncEngine":
        from kvflow.core.engine_core import EngineCore
        from kvflow.models.loader import resolve_model_path
        from kvflow.tokenizer import Tokenizer

        t0 = time.perf_counter()
        tokenizer = Tokenizer.from_model(resolve_model_path(config.tokenizer or config.model))
        core = EngineCore(config, eos_token_ids=tokenizer.eos_token_ids)   # logs weights, load time, KV size
        load_s = time.perf_counter() - t0
        # as vLLM: the model argument as given; the embedded default by its name, without file suffixes
        name = config.served_model_name or config.model or core.model_path.name.split(".")[0]
        metrics = EngineMetrics(name, max_model_len=int(core.max_model_len), max_num_seqs=config.max_num_seqs,
                                max_num_batched_tokens=config.max_num_batched_tokens, request_log=request_log,
                                log_stats_interval=log_stats_interval)
        engine = cls(core, tokenizer, served_model_name=name, max_queue_len=max_queue_len, metrics=metrics)
        engine.load_time_s = load_s
        logger.info("engine ready in %.2fs: serving %s, max_model_len %d", load_s, name, core.max_model_len)
        return engine

    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._record_stats(stepped=False)
            self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)
            self._thread.start()
            self.metrics.set_engine_alive(True)
        return self

    @property
    def death_reason(self) -> str | None:
        """Why the engine loop died, or None while it lives."""
        return self._dead

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_alive

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def shutdown(self, grace_period: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish within `grace_period`, abort the rest, stop the thread."""
        self._accepting = False
        deadline = time.monotonic() + grace_period
        while self._streams and self.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._streams:
            logger.warning("shutdown: aborting %d request(s) still running after %.1fs",
                           len(self._streams), grace_period)
            for stream in list(self._streams.values()):
                stream._fail("the server is shutting down")
            await asyncio.sleep(0)
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (does not wait for requests: see `shutdown`)."""
        self._accepting = False
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():    # never while a step may still run
            self.core.shutdown()
        self.metrics.set_engine_alive(False)
        self.metrics.close()

    # ---- asyncio side ------------------------------------------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns() & 0xffffff:06x}"

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Return max_tokens (filled in when None); ValueError with both numbers when it does not fit."""
        if num_prompt_tokens < 1:
            raise ValueError("the prompt is empty: give at least one token")
        limit = self.max_model_len
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise ValueError(
                    f"This model's maximum context length is {limit} tokens. However, your prompt has "
                    f"{num_prompt_tokens} tokens, which leaves no room for the completion. "
                    f"Please reduce the length of the prompt.")
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                f"for the completion). Please reduce the length of the prompt or max_tokens.")
        return max_tokens

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               arrival_time: float | None = None) -> RequestStream:
        """Hand a request to the engine; call from the event loop. Raises ValueError (bad request),
        EngineOverloadedError (queue full), EngineShutdownError, EngineDeadError before anything runs."""
        loop = asyncio.get_running_loop()
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead}")
        if not self._accepting:
            raise EngineShutdownError("the server is shutting down")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        prompt_token_ids = list(prompt_token_ids)
        max_tokens = self.check_length(len(prompt_token_ids), params.max_tokens)
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        arrival = time.time() if arrival_time is None else arrival_time
        n = params.n
        stream = RequestStream(self, request_id, prompt_token_ids, params, arrival, loop)
        adds = []
        for i in range(n):
            core_id = request_id if n == 1 else f"{request_id}-{i}"
            child = params if n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            detok = self._make_detokenizer(child)
            stream.choices.append(_Choice(i, core_id, RequestTimings(arrival=arrival), detok))
            adds.append(("add", core_id, prompt_token_ids, child, arrival))
        with self._cond:
            if self._dead is not None:
                raise EngineDeadError(f"the engine loop died: {self._dead}")
            if self.max_queue_len is not None and self._core_waiting + self._pending_adds >= self.max_queue_len:
                raise EngineOverloadedError(
                    f"the server is overloaded: {self._core_waiting + self._pending_adds} requests are waiting "
                    f"(--max-queue-len {self.max_queue_len}); retry later")
            self._streams[request_id] = stream
            for i, c in enumerate(stream.choices):
                self._routes[c.core_id] = (stream, i)
            self._pending_adds += len(adds)
            self._inbox.extend(adds)
            self._cond.notify()
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[CompletionDelta]:
        stream = self.submit(request_id, prompt_token_ids, params, arrival_time)
        async for delta in stream:
            yield delta

    def _make_detokenizer(self, params: SamplingParams):
        if self.tokenizer is None:
            return None
        from kvflow.detokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                      stop=list(params.stop or []),
                                      include_stop_str_in_output=params.include_stop_str_in_output)

    def _abort_core(self, core_ids: list[str]) -> None:
        with self._cond:
            self._inbox.append(("abort", list(core_ids)))
            self._cond.notify()

    def _unroute(self, core_id: str) -> None:
        self._routes.pop(core_id, None)

    def _request_done(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        for c in stream.choices:
            self._routes.pop(c.core_id, None)
        try:
            self.metrics.record_finished(FinishedRequest(
                request_id=stream.request_id, model=self.served_model_name,
                prompt_tokens=stream.num_prompt_tokens, cached_tokens=stream.num_cached_tokens,
                completion_tokens=stream.num_completion_tokens,
                finish_reasons=[c.finish_reason or "abort" for c in stream.choices],
                timings=[c.timings for c in stream.choices], error=stream.error))
        except Exception:  # metrics must never break a request
            logger.exception("recording metrics of %s failed", stream.request_id)

    def _dispatch(self, batch: list) -> None:
        """On the event loop: route one step's outputs to their streams."""
        for out, times in batch:
            route = self._routes.get(out.request_id)
            if route is None:
                continue          # aborted by us (stop string, disconnect): its last output is not needed
            stream, index = route
            stream._put(("output", index, (out, times)))

    def _dispatch_errors(self, items: list) -> None:
        for core_id, message in items:
            route = self._routes.get(core_id)
            if route is not None:
                route[0]._fail(message)

    # ---- engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        try:
            has_work = False
            while True:
                with self._cond:
                    if not self._inbox and not has_work and not self._stop:
                        self._cond.wait(HEALTH_CHECK_INTERVAL_S)
                    if self._stop:
                        break
                    items = list(self._inbox)
                    self._inbox.clear()
                if not items and not has_work:
                    core.check_health()         # raises when the engine cannot step any more
                    continue
                n_added = self._apply(items)
                stepped = False
                n_new = 0
                if core.has_unfinished_requests():
                    t0 = time.time()
                    outputs = core.step()
                    t1 = time.time()
                    stepped = True
                    self.num_steps += 1
                    if self._unscheduled:
                        self._mark_scheduled(t0)
                    if outputs:
                        by_loop: dict = {}
                        for out in outputs:
                            n_new += len(out.new_token_ids)
                            if out.finished:
                                self._live_core_ids.discard(out.request_id)
                            route = self._routes.get(out.request_id)
                            if route is None:
                                continue
                            by_loop.setdefault(route[0].loop, []).append((out, (t0, t1)))
                        for loop, batch in by_loop.items():
                            _call_soon(loop, self._dispatch, batch)
                has_work = core.has_unfinished_requests()
                self._record_stats(stepped, n_new, n_added)
        except BaseException as e:  # noqa: BLE001 - the loop must report any death
            self._on_death(e)
            if not isinstance(e, Exception):
                raise

    def _apply(self, items: list) -> int:
        """Engine thread: hand the inbox to the core. Returns how many adds were taken."""
        n_added = 0
        errors = []
        for item in items:
            if item[0] == "add":
                _, core_id, prompt, params, arrival = item
                n_added += 1
                try:
                    self.core.add_request(core_id, prompt, params, arrival_time=arrival)
                    self._live_core_ids.add(core_id)
                    route = self._routes.get(core_id)
                    if route is not None:
                        timings = route[0].choices[route[1]].timings
                        timings.added = time.time()
                        self._unscheduled[core_id] = timings
                except ValueError as e:
                    errors.append((core_id, str(e)))
            else:
                ids = [i for i in item[1] if i in self._live_core_ids]
                for i in item[1]:
                    self._unscheduled.pop(i, None)
                if ids:
                    self.core.abort(ids)
        if errors:
            by_loop: dict = {}
            for core_id, msg in errors:
                route = self._routes.get(core_id)
                if route is not None:
                    by_loop.setdefault(route[0].loop, []).append((core_id, msg))
            for loop, batch in by_loop.items():
                _call_soon(loop, self._dispatch_errors, batch)
        return n_added

    def _mark_scheduled(self, step_start: float) -> None:
        """Queue time ends (and prefill starts) when the scheduler first admits a request."""
        done = []
        for core_id, timings in self._unscheduled.items():
            req = self.core.requests.get(core_id)   # None: it finished within this very step
            if req is None or req.first_scheduled_time is not None:
                if timings.scheduled is None:
                    timings.scheduled = req.first_scheduled_time if req is not None else step_start
                done.append(core_id)
        for core_id in done:
            del self._unscheduled[core_id]

    def _record_stats(self, stepped: bool, n_new: int = 0, n_added: int = 0) -> None:
        stats = self.core.stats()
        self.last_stats = stats
        with self._cond:
            self._core_waiting = int(stats.get("num_waiting", 0))
            self._pending_adds = max(0, self._pending_adds - n_added)
        if stepped:
            self.max_batch_size = max(self.max_batch_size, int(stats.get("last_step_batch_size", 0)))
        self.metrics.record_step(stats, n_new, stepped=stepped)

    def _on_death(self, exc: BaseException) -> None:
        logger.exception("the engine loop died: %r", exc)
        message = f"the engine loop died: {type(exc).__name__}: {exc}"
        with self._cond:
            self._dead = message
            self._accepting = False
        self.metrics.set_engine_alive(False)
        by_loop: dict = {}
        for stream in list(self._streams.values()):
            by_loop.setdefault(stream.loop, []).append(stream)
        for loop, streams in by_loop.items():
            _call_soon(loop, _fail_all, streams, message)
        if self.on_death is not None:
            try:
                self.on_death()
            except Exception:  # noqa: BLE001 - the death is already reported
                logger.exception("the engine's death callback failed")


def _fail_all(streams: list[RequestStream], message: str) -> None:
    for s in streams:
        s._fail(message)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass
