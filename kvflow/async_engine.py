"""AsyncEngine: the frontend's side of the engine. The engine (EngineCore's step loop) runs in its own process
(`engine_process.py`); the asyncio event loop submits requests and reads them as streams.

Who owns what: the engine process owns the core and nothing else; everything per request (routing, text,
stop strings, timings, metrics) lives on the event loop, in the OutputProcessor. Only typed messages cross
(`core/messages.py`): `AddRequest` / `AbortRequests` to the engine, one `StepResult` per turn of its loop back,
handed from a reader thread to the event loop (`loop.call_soon_threadsafe`).

Beam search (`beam_search`, vLLM's, kvflow/beam_search.py) runs here, in the frontend, as vLLM's server runs it: each
step submits every live beam as a one-token request (`cache_prefix`: the beams share their prompt's KV blocks), the
step's requests together so they batch; its `BeamSearchStream` reads like a RequestStream.

Sleep (vLLM's sleep mode, and llama-server's --sleep-idle-seconds) is decided here: `sleep` drains the requests in
flight (mode "wait") or aborts them (mode "abort"), then the engines drop their KV cache (level 1) and their weights
(level 2); after an explicit sleep new requests get EngineSleepingError until `wake_up`, while after an idle sleep
the next request wakes the engines (a WakeUp sent ahead of it on the same socket: the engine takes them in order).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from typing import AsyncIterator

from kvflow.beam_search import BeamSearch, BeamSearchParams
from kvflow.core.messages import AbortRequests, AddRequest, EngineDead, EngineReady, Sleep, StepResult, WakeUp
from kvflow.core.request_validator import RequestValidator
from kvflow.engine_process import EngineProcess
from kvflow.engine_router import EngineRouter
from kvflow.errors import InvalidRequestError
from kvflow.lora_request import LoRARequest
from kvflow.metrics import EngineMetrics, FinishedRequest, RequestTimings
from kvflow.output_processor import ChoiceState, CompletionDelta, OutputProcessor, RequestState
from kvflow.request_log import RequestLog
from kvflow.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "RequestStream", "BeamSearchStream", "CompletionDelta", "RequestFailedError",
           "EngineDeadError", "EngineOverloadedError", "EngineShutdownError", "EngineSleepingError", "AddRequest",
           "AbortRequests", "StepResult", "SLEEP_MODES", "SLEEP_TAGS"]

logger = logging.getLogger("kvflow.async_engine")

# vLLM's /sleep modes for the requests in flight: "wait" lets them finish (kvflow's default), "abort" ends them with
# finish_reason "abort" (vLLM's default); vLLM's third, "keep" (pause them and resume after waking), is refused
SLEEP_MODES = ("wait", "abort")
# vLLM's wake_up tags (what to bring back; none: everything asleep)
SLEEP_TAGS = ("weights", "kv_cache")
# what an idle sleep (--sleep-idle-seconds) lets go of: as llama-server's, the model too
IDLE_SLEEP_LEVEL = 2


class RequestFailedError(RuntimeError):
    """The engine could not finish this request."""


class EngineDeadError(RequestFailedError):
    """The engine loop died: nothing more will come out of it."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (`--max-queue-len`): try again later."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


class EngineSleepingError(RuntimeError):
    """The engine was put to sleep (POST /sleep, LLM.sleep): it takes no requests until it is woken."""


class RequestStream:
    """The asyncio side of one request (all of its `n` choices). Iterate it for `CompletionDelta`s."""

    def __init__(self, engine: "AsyncEngine", state: RequestState) -> None:
        self.engine = engine
        self.state = state
        self.error: str | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self.priority = 0
        # an HTTP request's record holds this stream: the server writes its request-log line (server/request_record.py)
        self.recorded = False

    def __getattr__(self, name: str):
        """The request's own numbers (request_id, params, num_prompt_tokens, ..., finished) are its state's."""
        return getattr(self.state, name)

    def __aiter__(self) -> AsyncIterator[CompletionDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[CompletionDelta]:
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, str):         # the engine died, or is shutting down: no more deltas
                    self.error = item
                    raise (EngineDeadError if self.engine.death_reason else RequestFailedError)(item)
                deltas, last = item
                for delta in deltas:
                    if delta.finish_reason == "error":
                        self.error = str(delta.stop_reason)
                        raise RequestFailedError(self.error)
                    yield delta
                # whether *this* step finished the request: the state may already be finished by a later step
                # still waiting in the queue (checking the state here once dropped those last deltas)
                if last:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Abort whatever is unfinished (client went away, consumer stopped) and record the request."""
        if not self._closed:
            self._closed = True
            self.engine._finish(self, "error" if self.error else "abort")


class BeamSearchStream:
    """One beam search on the event loop (`AsyncEngine.beam_search`), read as a RequestStream is read: iterating it
    runs the search's steps (the first one is submitted already) and then yields one whole CompletionDelta per beam,
    best first (choice i: the i-th best). `state` is a RequestState of beam_width choices, for usage and the request
    log: the prompt, each beam's tokens once done, the prompt's cached tokens (its first step's). A step's request
    that fails fails the search (RequestFailedError); closing the stream aborts the step in flight."""

    def __init__(self, engine: "AsyncEngine", search: BeamSearch, state: RequestState,
                 step_request: AddRequest) -> None:
        self.state = state
        self.engine = engine
        self.search = search
        self.error: str | None = None
        # each step's requests: this record with a live beam's tokens (the search's priority, adapter and other
        # per-request fields carried over; one-token steps that take the prefix cache)
        self.step_request = step_request
        self.priority = step_request.priority
        self.recorded = False
        self.steps: list[RequestStream] = []        # the step in flight: one request per live beam
        self._closed = False

    def __getattr__(self, name: str):
        return getattr(self.state, name)

    def __aiter__(self) -> AsyncIterator[CompletionDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[CompletionDelta]:
        try:
            try:
                output = await self._run()
            except RequestFailedError as e:
                self.error = str(e)
                raise
            deltas = self._finish(output)
            for delta in deltas:
                yield delta
        finally:
            self.close()

    async def _run(self):
        search = self.search
        while True:
            tasks = [asyncio.ensure_future(_step_logprobs(s)) for s in self.steps]
            try:
                results = await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()          # the others, when one failed (no-op on the finished)
            if search.num_steps == 0:    # the prompt's own request: its prefix-cache hits are the prompt's
                self.state.num_cached_tokens = self.steps[0].num_cached_tokens
                first = self.steps[0].state.choices[0].timings
                for c in self.state.choices:
                    c.timings.queued, c.timings.scheduled = first.queued, first.scheduled
            self.steps = []
            search.advance(results)
            if search.done:
                return search.output()
            self.steps = self.engine._beam_step(self)

    def _finish(self, output) -> list[CompletionDelta]:
        """The beams as choices (vLLM's server: token ids without EOS unless include_stop_str_in_output, the text
        without it ever), best first; recorded on the state."""
        now = time.time()
        skip = self.search.params.skip_special_tokens
        deltas = []
        for i, (beam, choice) in enumerate(zip(output.sequences, self.state.choices)):
            token_ids, text_ids = self.search.completion(beam)
            text = self.engine.tokenizer.decode(text_ids, skip)
            choice.token_ids, choice.text = token_ids, text
            choice.finish_reason, choice.stop_reason = beam.finish_reason, beam.stop_reason
            t = choice.timings
            t.first_token = t.last_token = t.finished = now    # no token is final before the search ends
            t.token_times = [now] * len(token_ids)
            deltas.append(CompletionDelta(i, text, token_ids, None, beam.finish_reason, beam.stop_reason))
        return deltas

    def close(self) -> None:
        """Abort the step in flight, if any (the client went away, the consumer stopped)."""
        if not self._closed:
            self._closed = True
            for s in self.steps:
                s.close()
            self.steps = []
            self.engine._beam_searches.pop(self.state.request_id, None)
            for c in self.state.choices:
                if c.finish_reason is None:
                    c.finish_reason = "error" if self.error else "abort"


def _log_wake_failure(future) -> None:
    result = future.result()
    if result.error is not None:
        logger.error("waking the engine for a request failed: %s", result.error)


async def _step_logprobs(stream: RequestStream) -> dict[int, float] | None:
    """A beam step's one token's logprobs (None when its request ended without a token)."""
    logprobs = None
    async for delta in stream:
        if delta.logprobs:
            logprobs = delta.logprobs[0]
    return logprobs


class AsyncEngine:
    """Serves asyncio callers (on one event loop) from one engine process, or several (data parallel: each
    request goes to one of them, `engine_router.py`)."""

    def __init__(self, processes: list[EngineProcess], ready: EngineReady, tokenizer, config, model_path, *,
                 served_model_name: str | None = None, max_queue_len: int | None = None,
                 request_log: str | None = None, log_stats_interval: float = 5.0,
                 request_log_options: dict | None = None, sleep_idle_seconds: float | None = None) -> None:
        self.processes = processes
        self.process = processes[0]
        self.router = EngineRouter(len(processes), config.block_size)
        self.tokenizer = tokenizer
        self.config = config
        self.model_path = model_path
        # as vLLM: the model argument as given; the embedded default by its name, without file suffixes
        self.served_model_name = (served_model_name or config.served_model_name or config.model
                                  or model_path.name.split(".")[0])
        self.max_model_len: int = ready.max_model_len
        self.vocab_size: int = ready.vocab_size
        self.validator = RequestValidator(ready.vocab_size, ready.max_model_len, ready.tasks, ready.architecture)
        self.max_queue_len = max_queue_len
        # the request log's writer thread (request_log.py); it hashes the model for model_version unless labelled
        self.request_log = RequestLog(request_log, model_path=model_path, **(request_log_options or {})) \
            if request_log else None
        self.metrics = EngineMetrics(
            self.served_model_name, max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            request_log=self.request_log, log_stats_interval=log_stats_interval)
        self.metrics.record_cache_config(config, ready.num_blocks, num_engines=len(processes),
                                         num_state_slots=ready.num_state_slots)
        self.metrics.weights_bytes.set(ready.weights_bytes * len(processes))
        self.metrics.kv_cache_bytes.set(ready.kv_cache_bytes * len(processes))
        self.metrics.compiled_decode_buckets_ready.set(ready.stats.compiled_decode_buckets_ready)
        self.metrics.compiled_decode_buckets_total.set(ready.stats.compiled_decode_buckets_total)
        self.processor = OutputProcessor(tokenizer)
        # sleep: None awake, "explicit" (POST /sleep: requests refused until /wake_up) or "idle" (after
        # sleep_idle_seconds with no request: the next one wakes the engines); the level slept at
        self.sleep_idle_seconds = sleep_idle_seconds
        self._sleep: str | None = None
        self.sleep_level = 0
        self._last_activity = time.monotonic()
        self._idle_task: asyncio.Task | None = None
        if getattr(config, "enable_sleep_mode", False) or sleep_idle_seconds:
            self.metrics.record_sleep_level(0, len(processes))

        self.death_reason: str | None = None      # why the engine died; None while it lives
        # event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = True
        self._listening = False
        self._stopped = False
        self._streams: dict[str, RequestStream] = {}
        self._beam_searches: dict[str, BeamSearchStream] = {}     # by request id, until each ends
        self._failing: str | None = None    # shutdown failed what was left: beam searches submit no more steps
        self._pending_adds = 0      # sent to the engines, not yet taken by a core
        self._core_waiting = 0      # num_waiting of the engines' last steps
        self._engine_of: dict[str, int] = {}       # core id -> the engine running it
        self._engine_stats = [ready.stats] * len(processes)     # each engine's last gauges
        self.last_stats = ready.stats
        self.num_steps = 0
        self.max_batch_size = 0
        # called once, on the reader thread, after the engine died and its requests were failed
        # (`kvflow serve` sets it to stop the server, which then exits non-zero)
        self.on_death = None
        # the dashboard's hub (server/dashboard.py), or None: told of every step's stats and every finished request
        self.observer = None
        # LoRA adapters served (enable_lora): name -> LoRARequest; every load gets a fresh id (slots, prefix cache)
        self.loras: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        self.model_config = None      # the base model's ModelConfig (from_config sets it): adapters are checked on it

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config, *, max_queue_len: int | None = None, request_log: str | None = None,
                    log_stats_interval: float = 5.0, request_log_options: dict | None = None,
                    sleep_idle_seconds: float | None = None) -> "AsyncEngine":
        from kvflow.models.model_files import resolve_model_files
        from kvflow.tokenizer import Tokenizer

        t0 = time.perf_counter()
        files = resolve_model_files(config.model, config.tokenizer, config.hf_overrides)
        tokenizer = Tokenizer.from_files(files)
        processes = [EngineProcess(config, tokenizer.eos_token_ids) for _ in range(config.data_parallel_size)]
        try:
            for process in processes:           # they load at once; each logs weights, load time, KV size
                process.spawn()
            readies = [process.wait_ready() for process in processes]
        except BaseException:
            for process in processes:
                process.kill()
            raise
        engine = cls(processes, readies[0], tokenizer, config, files.path, max_queue_len=max_queue_len,
                     request_log=request_log, log_stats_interval=log_stats_interval,
                     request_log_options=request_log_options, sleep_idle_seconds=sleep_idle_seconds)
        engine.model_config = files.config
        logger.info("engine ready in %.2fs (engine process pid %s): serving %s, max_model_len %d",
                    time.perf_counter() - t0, " ".join(str(r.pid) for r in readies), engine.served_model_name,
                    engine.max_model_len)
        return engine

    def start(self) -> "AsyncEngine":
        """Start delivering the engine's results to the running event loop (or the one given to the first
        `submit`)."""
        if not self._listening:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                pass
            self._listening = True
            for rank, process in enumerate(self.processes):
                process.listen(lambda message, rank=rank: self._on_message(message, rank))
            self.metrics.engine_alive.set(1)
            if self.sleep_idle_seconds and self._loop is not None:
                self._idle_task = self._loop.create_task(self._sleep_when_idle())
        return self

    @property
    def is_alive(self) -> bool:
        return self.death_reason is None and self._listening and all(p.is_alive for p in self.processes)

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_alive

    async def shutdown(self, grace_period: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish within `grace_period`, fail the rest, stop the engine."""
        self._accepting = False
        if self._idle_task is not None:
            self._idle_task.cancel()
        deadline = time.monotonic() + grace_period
        while (self._streams or self._beam_searches) and self.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._streams or self._beam_searches:
            logger.warning("shutdown: aborting %d request(s) still running after %.1fs",
                           len(self._streams) + len(self._beam_searches), grace_period)
            self._failing = "the server is shutting down"
            self._fail_all(self._failing)
            await asyncio.sleep(0)
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine process (does not wait for requests: see `shutdown`)."""
        self._accepting = False
        if self._stopped:
            return
        self._stopped = True
        for process in self.processes:
            process.stop(timeout)
        self.metrics.engine_alive.set(0)
        self.metrics.close()

    def call_core(self, method: str, *args, rank: int = 0):
        """`EngineCore.<method>(*args)` run in engine `rank` between steps (one of its UTILITY_METHODS); blocks,
        so not from the event loop."""
        return self.processes[rank].call(method, *args)

    # ---- sleep ------------------------------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self._sleep is not None

    async def sleep(self, level: int = 1, mode: str = "wait") -> None:
        """Put the engines to sleep once the requests in flight are done (mode "wait") or aborted (mode "abort"):
        level 1 drops the KV cache (and a hybrid's recurrent state), level 2 the weights too. From now until
        `wake_up`, `submit` raises EngineSleepingError. Returns when the engines sleep."""
        if level not in (1, 2):
            raise InvalidRequestError(f"level must be 1 or 2, got {level!r}", param="level", code="invalid_value")
        if mode not in SLEEP_MODES:
            raise InvalidRequestError(f"mode must be {' or '.join(SLEEP_MODES)}, got {mode!r} (vLLM's \"keep\", "
                                      "which pauses requests through the sleep, is not supported)", param="mode",
                                      code="invalid_value")
        if self.death_reason is not None:
            raise EngineDeadError(f"the engine loop died: {self.death_reason}")
        if not self._accepting:
            raise EngineShutdownError("the server is shutting down")
        self._sleep = "explicit"
        while (self._streams or self._beam_searches) and self.is_alive:
            if mode == "abort":      # again each turn: a beam search's next step is aborted too
                self._abort(list(self._engine_of))
            await asyncio.sleep(0.02)
        if self._sleep != "explicit":       # woken while the requests drained
            return
        await self._post_all(lambda call_id: Sleep(call_id, level))
        self._slept(max(self.sleep_level, level))

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back what `tags` name (vLLM's: weights, kv_cache; None: everything); True when the engines are
        wholly awake (they take requests again)."""
        unknown = [t for t in tags or () if t not in SLEEP_TAGS]
        if unknown:
            raise InvalidRequestError(f"unknown tag(s) {', '.join(map(repr, unknown))}: tags are "
                                      f"{', '.join(SLEEP_TAGS)}", param="tags", code="invalid_value")
        results = await self._post_all(lambda call_id: WakeUp(call_id, tuple(tags) if tags else None))
        awake = all(results)
        if awake:
            self._awake()
        return awake

    async def _post_all(self, make) -> list:
        """Send `make(call_id)` to every engine; their answers' values (RuntimeError if one failed)."""
        futures = [asyncio.wrap_future(p.post(make)) for p in self.processes]
        results = await asyncio.gather(*futures)
        for r in results:
            if r.error is not None:
                raise RuntimeError(r.error)
        return [r.value for r in results]

    def _slept(self, level: int) -> None:
        self.sleep_level = level
        self.metrics.record_sleep_level(level, len(self.processes))

    def _awake(self) -> None:
        self._sleep = None
        self._last_activity = time.monotonic()
        self._slept(0)

    async def _sleep_when_idle(self) -> None:
        """--sleep-idle-seconds: sleep (IDLE_SLEEP_LEVEL) once no request ran for that long."""
        idle = self.sleep_idle_seconds
        while not self._stopped:
            await asyncio.sleep(min(1.0, idle / 4))
            if (self._sleep is None and not self._streams and not self._beam_searches and self.is_accepting
                    and time.monotonic() - self._last_activity >= idle):
                self._sleep = "idle"
                self._slept(IDLE_SLEEP_LEVEL)
                logger.info("no request for %.0f s: sleeping (level %d)", idle, IDLE_SLEEP_LEVEL)
                try:
                    await self._post_all(lambda call_id: Sleep(call_id, IDLE_SLEEP_LEVEL))
                except Exception:  # noqa: BLE001 - an engine still awake takes the next request's WakeUp as a no-op
                    logger.exception("sleeping after %.0f s idle failed", idle)

    def _wake_for_request(self) -> None:
        """After an idle sleep: wake the engines ahead of the request about to be sent (same socket, in order)."""
        logger.info("a request after an idle sleep: waking the engines")
        for process in self.processes:
            future = process.post(lambda call_id: WakeUp(call_id, None))
            future.add_done_callback(_log_wake_failure)
        self._awake()

    # ---- LoRA adapters -----------------------------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Check a PEFT adapter folder against the base model (its config and tensor shapes; no tensor read) and
        serve it as model `name`. Raises LoRAAdapterError (a ValueError naming the problem): LoRA off, the name in
        use, a bad path, a rank above --max-lora-rank, an unsupported config or shapes. The engine reads the weights
        when a request first needs them."""
        from kvflow.models.lora_adapter import LoRAAdapterError, inspect_adapter

        if not getattr(self.config, "enable_lora", False):
            raise LoRAAdapterError("LoRA adapters need the server started with --enable-lora")
        if not name:
            raise LoRAAdapterError("lora_name must not be empty")
        if name in self.loras or name == self.served_model_name:
            raise LoRAAdapterError(f"The lora adapter '{name}' has already been loaded (the name is in use)")
        if self.model_config is None:
            raise LoRAAdapterError("the base model's config is unknown: cannot check the adapter")
        inspect_adapter(path, self.model_config, self.config.max_lora_rank, name,
                        getattr(self.config, "lora_target_modules", None))
        lora = LoRARequest(name, next(self._lora_ids), str(path), self.served_model_name)
        self.loras[name] = lora
        logger.info("LoRA adapter %r (id %d) from %s", name, lora.lora_int_id, path)
        return lora

    def remove_lora(self, name: str) -> LoRARequest:
        """Stop serving adapter `name` (KeyError when unknown): new requests for it are refused; requests already
        submitted run to their end (they carry the adapter; the engine drops its weights by LRU)."""
        return self.loras.pop(name)

    # ---- event loop side ---------------------------------------------------------------------------------------
    def submit(self, request: AddRequest) -> RequestStream:
        """Hand a request to the engine; call from the event loop. Admits it (the prompt truncated, max_tokens
        resolved: `RequestValidator.admit`) and raises InvalidRequestError (bad request), EngineOverloadedError
        (queue full), EngineShutdownError, EngineDeadError before anything runs. An embedding request (`pooling`)
        has a stream that ends with one delta carrying the vector."""
        self._check_accepting()
        prompt_token_ids, max_tokens = self.validator.admit(request.prompt_token_ids, request.params, request.pooling)
        if request.request_id in self._streams or request.request_id in self._beam_searches:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", param="request_id")
        self._check_queue(request.params.n, "n")
        if self._sleep == "idle":
            self._wake_for_request()
        return self._enqueue(dataclasses.replace(request, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens))

    def _check_accepting(self) -> None:
        if self.death_reason is not None:
            raise EngineDeadError(f"the engine loop died: {self.death_reason}")
        if not self._accepting:
            raise EngineShutdownError("the server is shutting down")
        if self._sleep == "explicit":
            raise EngineSleepingError("the engine is sleeping (POST /sleep): POST /wake_up wakes it")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    def _check_queue(self, n: int, param: str) -> None:
        """--max-queue-len: `n` more core requests at once (`param` names what asks for them)."""
        limit = self.max_queue_len
        if limit is None:
            return
        if n > limit:
            raise InvalidRequestError(f"{param}={n} is more than the server queues at once "
                                      f"(--max-queue-len {limit})", param=param, code="invalid_value")
        queued = self._core_waiting + self._pending_adds
        if queued + n > limit:
            raise EngineOverloadedError(f"the server is overloaded: {queued} requests are waiting "
                                        f"(--max-queue-len {limit}); retry later")

    def _enqueue(self, request: AddRequest) -> RequestStream:
        """An admitted request (checked, max_tokens resolved) to its engine; its stream."""
        self._last_activity = time.monotonic()
        adds = self.processor.add_request(request)
        stream = RequestStream(self, self.processor.requests[request.request_id])
        stream.priority = request.priority
        self._streams[request.request_id] = stream
        self._pending_adds += len(adds)
        rank = self.router.choose(request.prompt_token_ids)     # every choice of a request on one engine: one prefill
        for add in adds:
            self._engine_of[add.request_id] = rank
        self.router.load[rank] += len(adds)
        try:
            self.processes[rank].send(*adds)
        except OSError:     # the engine is gone: its death is being reported, and fails this stream too
            pass
        return stream

    def beam_search(self, request: AddRequest, params: BeamSearchParams) -> BeamSearchStream:
        """vLLM's beam search of one prompt (kvflow/beam_search.py); call from the event loop. `request`: the
        prompt's record, whose SamplingParams give only the prompt's truncation (`params` the search). Checks it and
        submits its first step, raising as `submit` does before anything runs (InvalidRequestError names
        `beam_width` where `submit` names `n`); iterate the stream for the beams. Each later step submits the live
        beams as one-token requests that share the prompt's KV blocks; the search ends like a request (shutdown
        lets it finish within the grace period)."""
        self._check_accepting()
        params.validate()
        request_id = request.request_id
        truncate_prompt_tokens = request.params.truncate_prompt_tokens
        truncation_side = request.params.truncation_side
        limits = SamplingParams(max_tokens=params.max_tokens, truncate_prompt_tokens=truncate_prompt_tokens,
                                truncation_side=truncation_side)
        prompt_token_ids, max_tokens = self.validator.admit(request.prompt_token_ids, limits)
        if request_id in self._streams or request_id in self._beam_searches:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        self._check_queue(params.beam_width, "beam_width")
        search = BeamSearch(prompt_token_ids, params, max_tokens, self.tokenizer.eos_token_ids)
        arrival = request.arrival_time
        # what the request asks for, as usage and the request log read it: beam_width choices
        summary = SamplingParams(n=params.beam_width, max_tokens=max_tokens, temperature=params.temperature,
                                 ignore_eos=params.ignore_eos, skip_special_tokens=params.skip_special_tokens,
                                 include_stop_str_in_output=params.include_stop_str_in_output,
                                 truncate_prompt_tokens=truncate_prompt_tokens, truncation_side=truncation_side)
        state = RequestState(request_id, prompt_token_ids, summary,
                             [ChoiceState(i, f"{request_id}-beam-{i}", RequestTimings(arrival=arrival), None)
                              for i in range(params.beam_width)])
        step_request = dataclasses.replace(request, params=params.step_params(), max_tokens=1, cache_prefix=True)
        stream = BeamSearchStream(self, search, state, step_request)
        if self._sleep == "idle":
            self._wake_for_request()
        stream.steps = self._beam_step(stream)
        self._beam_searches[request_id] = stream
        return stream

    def _beam_step(self, stream: BeamSearchStream) -> list[RequestStream]:
        """Submit the live beams of `stream`'s search as one-token requests (all or none); their streams. A step
        after the first belongs to an admitted request: neither shutdown nor the queue limit refuses it."""
        if self.death_reason is not None:
            raise EngineDeadError(f"the engine loop died: {self.death_reason}")
        if self._failing is not None:
            raise RequestFailedError(self._failing)
        search = stream.search
        steps: list[RequestStream] = []
        try:
            for i, tokens in enumerate(search.step_prompts()):
                rid = f"{stream.state.request_id}-step{search.num_steps}-beam{i}"
                step = self._enqueue(dataclasses.replace(stream.step_request, request_id=rid,
                                                         prompt_token_ids=tokens, arrival_time=time.time()))
                step.recorded = True        # the beam search is the request; its steps write no request-log lines
                steps.append(step)
        except BaseException:
            for step in steps:
                step.close()
            raise
        return steps

    def _abort(self, core_ids) -> None:
        """Tell each engine to stop its share of these core requests."""
        by_engine: dict[int, list[str]] = {}
        for core_id in core_ids:
            rank = self._engine_of.get(core_id)
            if rank is not None:
                by_engine.setdefault(rank, []).append(core_id)
        for rank, ids in by_engine.items():
            try:
                self.processes[rank].send(AbortRequests(tuple(ids)))
            except OSError:     # the engine is gone: its death is being reported
                pass

    def _forget(self, state: RequestState) -> None:
        for choice in state.choices:
            rank = self._engine_of.pop(choice.core_id, None)
            if rank is not None:
                self.router.load[rank] -= 1

    def _finish(self, stream: RequestStream, reason: str) -> None:
        """A request is done (finished, failed, or its consumer went away): abort what is left of it in the
        core, forget it, record its metrics."""
        unfinished = self.processor.finish(stream.request_id, reason, time.time())
        if unfinished:
            self._abort(unfinished)
        state = stream.state
        self._forget(state)
        self._last_activity = time.monotonic()      # idle time counts from the last request's end
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        try:
            self.metrics.record_finished(FinishedRequest(
                request_id=state.request_id, model=self.served_model_name, prompt_tokens=state.num_prompt_tokens,
                cached_tokens=state.num_cached_tokens, completion_tokens=state.num_completion_tokens,
                finish_reasons=[c.finish_reason or "abort" for c in state.choices],
                timings=[c.timings for c in state.choices], error=stream.error, n=state.params.n,
                # vLLM's server resolves an absent max_tokens (to what is left of the context) before its metrics
                # see it; an embedding request has none
                max_tokens=(None if state.pooling is not None else state.params.max_tokens
                            if state.params.max_tokens is not None else self.max_model_len - state.num_prompt_tokens),
                priority=stream.priority, logged=stream.recorded))
            if self.observer is not None:
                self.observer.on_finish(stream)
        except Exception:  # metrics must never break a request
            logger.exception("recording metrics of %s failed", state.request_id)

    def _on_step_result(self, result: StepResult, rank: int = 0) -> None:
        """On the event loop: account for the step, then route its outputs to their streams."""
        self._pending_adds = max(0, self._pending_adds - result.num_added)
        stats = self._engine_stats[rank] = result.stats
        if len(self.processes) > 1:        # the gauges over every engine, this step's counters
            every = self._engine_stats
            stats = dataclasses.replace(
                stats, num_running=sum(s.num_running for s in every), num_waiting=sum(s.num_waiting for s in every),
                kv_cache_usage=sum(s.kv_cache_usage for s in every) / len(every),
                compiled_decode_buckets_ready=min(s.compiled_decode_buckets_ready for s in every))
        self._core_waiting = stats.num_waiting
        self.last_stats = stats
        if stats.batch_size:
            self.num_steps += 1
            self.max_batch_size = max(self.max_batch_size, stats.batch_size)
        self.metrics.record_step(stats)
        if self.observer is not None:
            self.observer.on_step(stats)
        for core_id, message in result.rejected:
            state = self.processor.request_of(core_id)
            if state is not None and state.request_id in self._streams:
                self._streams[state.request_id].queue.put_nowait(message)
        processed = self.processor.process(result.outputs, result.started, result.finished)
        if processed.to_abort:
            self._abort(processed.to_abort)
        for request_id, deltas in processed.deltas.items():
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.queue.put_nowait((deltas, stream.state.finished))

    def _fail_all(self, message: str) -> None:
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(message)

    # ---- the reader thread -------------------------------------------------------------------------------------
    def _on_message(self, message, rank: int) -> None:
        if isinstance(message, EngineDead):
            if self.death_reason is None:
                self._on_death(message.reason)
        else:
            self._deliver(self._on_step_result, message, rank)

    def _deliver(self, fn, *args) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _on_death(self, reason: str) -> None:
        logger.error("the engine died: %s", reason)
        message = reason if reason.startswith("the engine loop died") else f"the engine loop died: {reason}"
        self.death_reason = message
        self._accepting = False
        self.metrics.engine_alive.set(0)
        self._deliver(self._fail_all, message)
        if self.on_death is not None:
            try:
                self.on_death()
            except Exception:  # noqa: BLE001 - the death is already reported
                logger.exception("the engine's death callback failed")
