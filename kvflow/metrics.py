"""Prometheus metrics with vLLM's names, per-request timings, the periodic stats log line and the request log.

Each server owns one `EngineMetrics` with a private `CollectorRegistry`, so several servers can live in one
process (tests do that). Engine-wide numbers (running, waiting, KV usage, prefix cache, preemptions, step
sizes) come from the `StepStats` of every engine step; per-request
numbers (TTFT, inter-token latency, end-to-end, phases, token counts, preemptions) are observed on the asyncio
side when a request finishes, from a `RequestTimings` record per choice that starts when the server received
the request.

vLLM's metrics keep vLLM's names, types, label names, buckets and meaning (vllm/v1/metrics/loggers.py and
stats.py), so its dashboards (examples/grafana/kvflow.json) and its tests read them unchanged; where kvflow's
value differs from what vLLM would report, the definition says why. vLLM's `engine` label is left out
(kvflow's data-parallel engines report as one), except on `vllm:cache_config_info` and `vllm:engine_sleep_state`, which
are per engine.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the server)

from kvflow.core.kv_cache_capacity import kv_cache_capacity
from kvflow.core.outputs import StepStats
from kvflow.request_log import RequestLog

logger = logging.getLogger("kvflow.metrics")

# vLLM's buckets, so existing dashboards' heatmaps look the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's fixed buckets of vllm:iteration_tokens_total, vllm:request_params_n and vllm:request_num_preemptions
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# vLLM's two reasons a request waits: "capacity" (for a slot, tokens or KV blocks) and "deferred" (held back by a
# transient constraint: LoRA budget, KV transfer, a blocked status). kvflow's scheduler only has the first.
WAITING_REASONS = ("capacity", "deferred")
# vllm:engine_sleep_state's sleep_state label: awake, then what each sleep level is called, as vLLM names them
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
# OpenAI's batch statuses (kvflow:batches{status})
BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                  "cancelled")
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# the StepStats counters the periodic log line sums up, for its rates
_TOTALS = ("num_prompt_tokens_computed", "num_generated_tokens", "prefix_cache_queries", "prefix_cache_hits",
           "num_preemptions", "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")


def _token_buckets(max_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's build_1_2_5_buckets)."""
    return [m * 10 ** e for e in range(len(str(max_len))) for m in (1, 2, 5) if m * 10 ** e <= max_len]


def _batch_buckets(max_num_seqs: int) -> list[int]:
    """The powers of two below max_num_seqs, then max_num_seqs."""
    return [2 ** i for i in range(max(max_num_seqs - 1, 0).bit_length())] + [max(max_num_seqs, 1)]


def process_resident_memory_bytes() -> float:
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except OSError:    # no /proc (not Linux): the peak, which is what the OS offers
        import resource
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


@dataclass
class RequestTimings:
    """What the metrics need of one choice (one core request): wall-clock times (time.time()) from the server's
    point of view, and the core's count of its preemptions."""
    arrival: float                       # the server received the HTTP request
    # it entered the core's waiting queue (vLLM's QUEUED event: after tokenization and the trip to the engine
    # process); None until an output says
    queued: float | None = None
    first_token: float | None = None     # the first new token reached the asyncio side
    last_token: float | None = None
    finished: float | None = None
    # start of the step that first computed this request (approximated by the step that produced its first
    # token when the core does not say): queue time ends and prefill begins there
    scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        """vLLM's: in the core's waiting queue until first scheduled (from arrival when the core did not say)."""
        if self.scheduled is None:
            return None
        return max(0.0, self.scheduled - (self.queued if self.queued is not None else self.arrival))

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass
class FinishedRequest:
    """What the request log and the per-request metrics need about one finished (parent) request."""
    request_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int            # all choices together
    finish_reasons: list[str]
    timings: list[RequestTimings]     # one per choice
    error: str | None = None
    n: int = 1                        # the request's n
    max_tokens: int | None = None     # each choice's max_tokens, resolved as vLLM's server resolves it
    priority: int = 0
    # the server writes this request's log line itself, at the end of its HTTP response (server/request_record.py)
    logged: bool = False


class EngineMetrics:
    """All metrics of one server, on a private registry."""

    def __init__(self, model_name: str, max_model_len: int = 4096, max_num_seqs: int = 128,
                 request_log: RequestLog | str | None = None, log_stats_interval: float = 5.0) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        # as vLLM does: no `*_created` series beside every counter and histogram (prometheus-client's switch)
        disable_created_metrics()
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.log_stats_interval = log_stats_interval

        # each series is labelled with the model name at once, so the page lists it from the start, as vLLM's does
        def gauge(name, doc):
            return Gauge(name, doc, ["model_name"], registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, ["model_name"], registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
            "Sum of all reasons equals vllm:num_requests_waiting.", ["model_name", "reason"], registry=r)
        self.num_requests_waiting_by_reason = {reason: waiting_by_reason.labels(model_name, reason)
                                               for reason in WAITING_REASONS}
        # as vLLM's: a gauge set to 1 whose labels are the cache config; created once the engine reports its
        # block count (`record_cache_config`)
        self.cache_config_info: Gauge | None = None
        self.spec_decode: dict[str, Counter] | None = None    # with --speculative-config (record_cache_config)
        self.spec_decode_per_pos: list = []
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.compiled_decode_buckets_ready = gauge(
            "kvflow:compiled_decode_buckets_ready", "Batch-size buckets whose compiled decode step is loaded.")
        self.compiled_decode_buckets_total = gauge(
            "kvflow:compiled_decode_buckets_total", "Batch-size buckets of the compiled decode step (0: off).")
        self.gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage. (older name of vllm:kv_cache_usage_perc)")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       ["model_name", "finished_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        # vLLM's name for the same observations until 0.11 (deprecated then, later removed): the dashboard many
        # people still run reads it
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            ITL_BUCKETS)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", LATENCY_BUCKETS)
        self.request_num_preemptions = histogram("vllm:request_num_preemptions",
                                                 "Histogram of the number of preemptions per request.",
                                                 PREEMPTIONS_BUCKETS)
        token_buckets = _token_buckets(max(max_model_len, 1))
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets)
        self.request_params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                          PARAMS_N_BUCKETS)
        self.request_params_max_tokens = histogram("vllm:request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        # what vLLM lacks and operators want
        self.step_batch_size = histogram("kvflow:step_batch_size", "Requests in one engine step.",
                                         _batch_buckets(max_num_seqs))
        self.step_duration = histogram("kvflow:step_duration_seconds", "Duration of one engine step.", STEP_BUCKETS)
        self.prompt_tokens_computed = counter("kvflow:prompt_tokens_computed",
                                              "Prompt tokens actually computed (not served from the prefix cache).")
        self.num_requests_aborted = counter("kvflow:num_requests_aborted",
                                            "Requests aborted (client disconnect, stop string, shutdown).")
        self.weights_bytes = gauge("kvflow:weights_bytes", "Bytes of model weights.")
        self.kv_cache_bytes = gauge("kvflow:kv_cache_bytes", "Bytes of the KV cache.")
        self.resident_memory = gauge("kvflow:process_resident_memory_bytes", "Resident memory of the server process.")
        self.resident_memory.set_function(process_resident_memory_bytes)
        self.engine_alive = gauge("kvflow:engine_alive", "1 while the engine loop is alive.")
        self.max_step_batch_size = gauge("kvflow:max_step_batch_size", "Largest batch run in one step so far.")
        # the online Batch API (server/batch_worker.py): lines committed, batches by status, lines still to run
        self.batch_requests = Counter("kvflow:batch_requests", "Batch API request lines finished (committed), by "
                                      "outcome: completed (status 200) or failed.", ["model_name", "status"],
                                      registry=r)
        for status in ("completed", "failed"):
            self.batch_requests.labels(model_name, status)
        self.batches = Gauge("kvflow:batches", "Batch API batches in the store, by status.", ["model_name", "status"],
                             registry=r)
        for status in BATCH_STATUSES:
            self.batches.labels(model_name, status)
        self.batch_queue_depth = gauge("kvflow:batch_queue_depth",
                                       "Request lines of in-progress batches not yet finished.")

        self._lock = threading.Lock()
        self._last_stats = StepStats()
        self._max_batch = 0
        # the periodic log line's state
        self._totals = dict.fromkeys(_TOTALS, 0)
        self._totals_at_log = dict(self._totals)
        self._log_last_time = time.monotonic()
        self._busy_since_log = False
        # the request log's writer (request_log.py), or None; a path: a log with the default rotation
        self.request_log = RequestLog(request_log) if isinstance(request_log, str) else request_log

    def record_cache_config(self, config, num_gpu_blocks: int, num_engines: int = 1,
                            num_state_slots: int | None = None) -> None:
        """vllm:cache_config_info, once the engines are loaded: one series per engine, labelled with the fields of
        vLLM's CacheConfig that kvflow has, as vLLM writes them (str() of the value); no model_name label, as
        vLLM's. kv_cache_size_tokens and kv_cache_max_concurrency are one engine's, as vLLM computes them
        (core/kv_cache_capacity.py): the concurrency a float's str(), not rounded (only vLLM's log line rounds it)."""
        size_tokens, max_concurrency = kv_cache_capacity(num_gpu_blocks, config.block_size, self.max_model_len,
                                                         num_state_slots)
        labels = {
            "block_size": str(config.block_size),
            "cache_dtype": str(config.kv_cache_dtype),
            "cpu_offload_gb": "0",                    # kvflow offloads no weights
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "kv_cache_max_concurrency": str(max_concurrency),
            "kv_cache_memory_bytes": str(config.kv_cache_memory),
            "kv_cache_size_tokens": str(size_tokens),
            "num_cpu_blocks": "0",                    # no CPU swap space (as vLLM v1)
            "num_gpu_blocks": str(num_gpu_blocks),    # the device's blocks: RAM on CPU
            "num_gpu_blocks_override": "None",
        }
        if self.cache_config_info is None:
            self.cache_config_info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                           [*labels, "engine"], registry=self.registry)
        for engine in range(num_engines):
            self.cache_config_info.labels(**labels, engine=str(engine)).set(1)
        spec = getattr(config, "speculative_config", None)
        if spec is not None and self.spec_decode is None:
            self._spec_decode_metrics(spec.num_speculative_tokens)

    def record_sleep_level(self, level: int, num_engines: int = 1) -> None:
        """vLLM's vllm:engine_sleep_state (only where the engine can sleep, as vLLM: with sleep mode on): per engine
        and `sleep_state`, awake 1 while awake, weights_offloaded 1 at level 1, discard_all 1 at level 2 (kvflow's
        level 1 keeps its weights where they are and drops the KV cache: vLLM's name is kept for its dashboards)."""
        if getattr(self, "engine_sleep_state", None) is None:
            self.engine_sleep_state = Gauge(
                "vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means "
                "engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
                ["model_name", "engine", "sleep_state"], registry=self.registry)
        for engine in range(num_engines):
            for i, state in enumerate(SLEEP_STATES):
                self.engine_sleep_state.labels(self.model_name, str(engine), state).set(int(i == level))

    def _record_lora(self, stats: StepStats) -> None:
        """vLLM's vllm:lora_requests_info (only with LoRA on, as vLLM): labels max_lora and the comma-separated
        adapters of waiting and of running requests, value the time of the update (set every step, as vLLM)."""
        if getattr(self, "lora_requests_info", None) is None:
            self.lora_requests_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                            registry=self.registry)
        self.lora_requests_info.labels(max_lora=str(stats.max_lora),
                                       waiting_lora_adapters=",".join(stats.lora_waiting),
                                       running_lora_adapters=",".join(stats.lora_running)).set_to_current_time()

    def _spec_decode_metrics(self, k: int) -> None:
        """vLLM's speculative decoding counters (only when it is on, as vLLM): drafts (requests that speculated in a
        step), draft tokens proposed, accepted tokens, and accepted tokens per draft position."""
        def counter(name, doc, *labels):
            return Counter(name, doc, ["model_name", *labels], registry=self.registry)

        per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                          "position")
        self.spec_decode = {
            "spec_num_drafts": counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.").labels(
                self.model_name),
            "spec_num_draft_tokens": counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.").labels(
                self.model_name),
            "spec_num_accepted_tokens": counter("vllm:spec_decode_num_accepted_tokens",
                                                "Number of accepted tokens.").labels(self.model_name),
        }
        self.spec_decode_per_pos = [per_pos.labels(self.model_name, str(j)) for j in range(k)]

    # ---- engine thread: after every step ----------------------------------------------------------------------
    def record_step(self, stats: StepStats) -> None:
        """After every engine step (or idle look): gauges, counters' deltas, step histograms."""
        if stats.max_lora:
            self._record_lora(stats)
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_waiting_by_reason["capacity"].set(stats.num_waiting)    # nothing is deferred in kvflow
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        self.compiled_decode_buckets_ready.set(stats.compiled_decode_buckets_ready)
        self.compiled_decode_buckets_total.set(stats.compiled_decode_buckets_total)
        for delta, ctr in ((stats.prefix_cache_queries, self.prefix_cache_queries),
                           (stats.prefix_cache_hits, self.prefix_cache_hits),
                           (stats.num_preemptions, self.num_preemptions),
                           (stats.num_prompt_tokens_computed, self.prompt_tokens_computed)):
            if delta > 0:
                ctr.inc(delta)
        if self.spec_decode is not None and stats.spec_num_drafts:
            for key, ctr in self.spec_decode.items():
                ctr.inc(getattr(stats, key))
            for ctr, n in zip(self.spec_decode_per_pos, stats.spec_accepted_per_pos):
                if n:
                    ctr.inc(n)
        if stats.iteration_tokens is not None:
            self.iteration_tokens.observe(stats.iteration_tokens)
        if stats.batch_size > 0:
            self.step_batch_size.observe(stats.batch_size)
            if stats.batch_size > self._max_batch:
                self._max_batch = stats.batch_size
                self.max_step_batch_size.set(stats.batch_size)
            self.step_duration.observe(stats.duration_s)
            self._busy_since_log = True
        for key in _TOTALS:
            self._totals[key] += getattr(stats, key)
        self._last_stats = stats
        self.maybe_log_stats()

    def maybe_log_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        dt = now - self._log_last_time
        if not force and (dt < self.log_stats_interval or not self._busy_since_log):
            return
        t, last, s = self._totals, self._totals_at_log, self._last_stats
        queries, hits = t["prefix_cache_queries"], t["prefix_cache_hits"]
        dq, dh = queries - last["prefix_cache_queries"], hits - last["prefix_cache_hits"]
        hit_rate = 100.0 * dh / dq if dq > 0 else (100.0 * hits / queries if queries > 0 else 0.0)
        logger.info(
            "Engine: prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, running %d reqs, "
            "waiting %d reqs, KV cache usage %.1f%%, prefix cache hit rate %.1f%%, preemptions %d",
            (t["num_prompt_tokens_computed"] - last["num_prompt_tokens_computed"]) / max(dt, 1e-9),
            (t["num_generated_tokens"] - last["num_generated_tokens"]) / max(dt, 1e-9),
            s.num_running, s.num_waiting, 100.0 * s.kv_cache_usage, hit_rate, t["num_preemptions"])
        drafts = t["spec_num_draft_tokens"] - last["spec_num_draft_tokens"]
        if drafts:      # as vLLM's SpecDecodingLogging
            accepted = t["spec_num_accepted_tokens"] - last["spec_num_accepted_tokens"]
            num_drafts = t["spec_num_drafts"] - last["spec_num_drafts"]
            logger.info("SpecDecoding metrics: draft acceptance rate %.1f%%, mean acceptance length %.2f, accepted "
                        "%d of %d draft tokens in %d drafts", 100.0 * accepted / drafts,
                        1.0 + accepted / max(num_drafts, 1), accepted, drafts, num_drafts)
        self._log_last_time = now
        self._totals_at_log = dict(t)
        self._busy_since_log = False

    # ---- asyncio side: when a request finishes -----------------------------------------------------------------
    def record_finished(self, req: FinishedRequest) -> None:
        """As vLLM: n and the longest choice once per request; everything else once per choice (vLLM's child
        requests: with n > 1 each one's prompt counts)."""
        self.generation_tokens.inc(req.completion_tokens)
        self.request_params_n.observe(req.n)
        self.request_max_num_generation_tokens.observe(max((len(t.token_times) for t in req.timings), default=0))
        for reason in req.finish_reasons:
            self.request_success.labels(self.model_name, reason or "error").inc()
            if reason == "abort":
                self.num_requests_aborted.inc()
        for t in req.timings:
            self.request_prompt_tokens.observe(req.prompt_tokens)
            if t.first_token is not None:
                self.prompt_tokens.inc(req.prompt_tokens)      # vLLM counts a prompt once it produced an output
                self.ttft.observe(t.first_token - t.arrival)
            for a, b in zip(t.token_times, t.token_times[1:]):
                self.itl.observe(b - a)
                self.time_per_output_token.observe(b - a)
            if t.finished is not None:
                self.e2e.observe(t.finished - t.arrival)
            if t.queue_time is not None:
                self.queue_time.observe(t.queue_time)
            if t.first_token is not None and t.scheduled is not None:
                self.prefill_time.observe(max(0.0, t.first_token - t.scheduled))
            if t.first_token is not None and t.last_token is not None:
                self.decode_time.observe(max(0.0, t.last_token - t.first_token))
            if t.scheduled is not None and t.last_token is not None:
                self.inference_time.observe(max(0.0, t.last_token - t.scheduled))
            num_tokens = len(t.token_times)
            # vLLM's per-request TPOT: the decode phase over the tokens after the first; 0 with fewer than two
            self.request_time_per_output_token.observe(
                (t.last_token - t.first_token) / (num_tokens - 1) if num_tokens > 1 else 0.0)
            self.request_generation_tokens.observe(num_tokens)
            self.request_num_preemptions.observe(t.num_preemptions)
            if req.max_tokens:
                self.request_params_max_tokens.observe(req.max_tokens)
        self._write_request_log(req)

    def _write_request_log(self, req: FinishedRequest) -> None:
        """The line of a request with no HTTP request of its own (the server writes the others)."""
        if self.request_log is None or req.logged:
            return
        self.request_log.write(request_line(req))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def close(self) -> None:
        if self.request_log is not None:
            self.request_log.close()


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def timing_fields(timings: list[RequestTimings], end: float | None = None) -> dict:
    """The request log's (and the trace span's) timings of one request, in seconds: queue time, TTFT and TPOT of
    its first choice (vLLM's per-request definitions: TPOT is the decode phase over the tokens after the first),
    end to end from arrival to its last choice's end (or `end`: when its HTTP response ended), and the
    preemptions of every choice."""
    first = timings[0] if timings else None
    ends = [t.finished for t in timings if t.finished is not None]
    if end is None and ends:
        end = max(ends)
    tpot = None
    if first is not None and first.first_token is not None and len(first.token_times) > 1:
        tpot = (first.last_token - first.first_token) / (len(first.token_times) - 1)
    return {
        "queue_time": _round(first.queue_time if first else None),
        "ttft": _round(first.ttft if first else None),
        "tpot": _round(tpot),
        "e2e": _round(end - first.arrival if first is not None and end is not None else None),
        "num_preemptions": sum(t.num_preemptions for t in timings),
    }


def request_line(req: FinishedRequest) -> dict:
    """The request log's line of a request that had no HTTP request of its own (a Batch API line)."""
    first = req.timings[0] if req.timings else None
    return {
        "time": _round(first.arrival if first else None),
        "id": req.request_id,
        "model": req.model,
        "prompt_tokens": req.prompt_tokens,
        "cached_tokens": req.cached_tokens,
        "completion_tokens": req.completion_tokens,
        **timing_fields(req.timings),
        "finish_reason": req.finish_reasons[0] if len(req.finish_reasons) == 1 else req.finish_reasons,
        "error": req.error,
        "n": req.n,
        "priority": req.priority,
    }
