"""`/dashboard`: a live view of the batch, in the browser, over Server-Sent Events (`/dashboard/events`).

What it costs, and when:
- Always (while the server runs, dashboard on): one tuple per engine step into a ring buffer (`on_step`, from
  `AsyncEngine._on_step_result`), one small dict per finished request into another (`on_finish`). Nothing per
  request per step; memory bounded by the rings (STEP_RING steps, REQUEST_RING requests).
- Only while a page is open: every INTERVAL_S each open page gets one message: the steps and finished requests
  since its last message, a snapshot of the running requests (per request, a few numbers), the gauges and the
  last minute's percentiles; about once a second the KV block map, asked of the engine process between steps
  (`EngineCore.kv_block_map`, one byte per block) on a worker thread. With no page open nothing is computed or
  sent.
- What it spends is measured and sent with every message (`cost`): the CPU seconds of the hub's own code on the
  event loop (`frontend_s`: on_step, on_finish, building, encoding and sending messages) and the engines' own time
  building the KV map between their steps (`engine_s`), against the hub's age (`uptime_s`). The page shows their
  sum as a share of the time; benchmarks/dashboard_overhead.py reads it over a run (the throughput difference it
  causes is smaller than the run-to-run noise of a 2-core machine).

The page itself (`static/dashboard.html`) is plain HTML + SVG/canvas + JS, shipped in the package: no build step,
no CDN.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, StreamingResponse

logger = logging.getLogger("kvflow.dashboard")

STEP_RING = 8192          # engine steps kept (a minute at ~135 steps/s)
REQUEST_RING = 2048       # finished requests kept
WINDOW_S = 60.0           # the percentiles' and throughput's window
INTERVAL_S = 0.25         # one message per open page this often
KV_MAP_INTERVAL_S = 1.0
KV_MAP_BUDGET = 0.005     # the block map's time in the engine <= 0.5% of the time
MAX_ACTIVE = 256          # running requests shown per message (the oldest first)
MAX_STEPS_PER_MESSAGE = 2048

# a step's columns, as sent (the page reads them by position)
STEP_FIELDS = ("seq", "t", "duration", "batch", "prefill_tokens", "decode_tokens", "preemptions", "compiled",
               "running", "waiting", "kv_usage", "generated")


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles (None without values)."""
    if not values:
        return {f"p{q}": None for q in qs}
    s = sorted(values)
    return {f"p{q}": s[min(len(s) - 1, max(0, -(-q * len(s) // 100) - 1))] for q in qs}


class DashboardHub:
    """The engine's recent history in ring buffers, and the SSE stream of it for each open page."""

    def __init__(self, engine) -> None:
        self.engine = engine
        config = engine.config
        self.steps: deque = deque(maxlen=STEP_RING)
        self.finished: deque = deque(maxlen=REQUEST_RING)
        self._step_seq = 0
        self._request_seq = 0
        self.clients = 0
        self.messages_sent = 0
        # a decode-only step of at most this many rows runs a compiled graph once every bucket is loaded
        self._max_bucket = 0 if getattr(config, "enforce_eager", False) else max(
            getattr(config, "compile_batch_sizes", ()) or (0,))
        self._kv_map: str = ""
        self._kv_map_at = 0.0
        self._kv_map_interval = KV_MAP_INTERVAL_S
        # what the hub has spent (see the module's docstring): the event loop's CPU seconds in its code (thread
        # time: on 2 busy cores, wall-clock time would count the spells the OS gives the engine), the engine's time
        # building KV maps
        self.started = time.monotonic()
        self.frontend_s = 0.0
        self.engine_s = 0.0
        engine.observer = self

    def cost(self) -> dict:
        return {"frontend_s": round(self.frontend_s, 6), "engine_s": round(self.engine_s, 6),
                "uptime_s": round(time.monotonic() - self.started, 6)}

    # ---- the engine's side (event loop): always on, O(1) per step and per finished request -------------------
    def on_step(self, stats) -> None:
        if not stats.batch_size:
            return
        t0 = time.thread_time()
        self._step_seq += 1
        prefill = stats.num_prompt_tokens_computed
        compiled = (prefill == 0 and stats.compiled_decode_buckets_total > 0
                    and stats.compiled_decode_buckets_ready == stats.compiled_decode_buckets_total
                    and stats.batch_size <= self._max_bucket)
        self.steps.append((self._step_seq, time.time(), stats.duration_s, stats.batch_size, prefill,
                           stats.num_batched_tokens - prefill, stats.num_preemptions, compiled, stats.num_running,
                           stats.num_waiting, stats.kv_cache_usage, stats.num_generated_tokens))
        self.frontend_s += time.thread_time() - t0

    def on_finish(self, stream) -> None:
        t0 = time.thread_time()
        state = stream.state
        self._request_seq += 1
        entry = request_entry(stream, finished=True)
        entry["seq"] = self._request_seq
        entry["reason"] = ",".join(sorted({c.finish_reason or "abort" for c in state.choices}))
        self.finished.append(entry)
        self.frontend_s += time.thread_time() - t0

    # ---- an open page -----------------------------------------------------------------------------------------
    def message(self, step_cursor: int, request_cursor: int, first: bool) -> dict:
        now = time.time()
        since = now - WINDOW_S
        # newest first, stopping at the window's start: the cost follows the last minute, not the rings' size
        window_steps = list(_newest_while(self.steps, lambda s: s[1] >= since))
        window_requests = list(_newest_while(self.finished, lambda r: r["end"] >= since - 30))
        steps = [s for s in window_steps if s[0] > step_cursor][:MAX_STEPS_PER_MESSAGE][::-1]
        finished = [r for r in window_requests if r["seq"] > request_cursor][::-1]
        window_requests = [r for r in window_requests if r["end"] >= since]
        active = [request_entry(s, finished=False) for s in list(self.engine._streams.values())[:MAX_ACTIVE]]
        span = min(WINDOW_S, now - window_steps[-1][1] + window_steps[-1][2]) if window_steps else WINDOW_S
        last = self.engine.last_stats
        stats = {
            "running": last.num_running, "waiting": last.num_waiting, "kv_usage": last.kv_cache_usage,
            "generation_throughput": sum(s[11] for s in window_steps) / span if window_steps else 0.0,
            "prompt_throughput": sum(s[4] for s in window_steps) / span if window_steps else 0.0,
            "steps_per_s": len(window_steps) / span if window_steps else 0.0,
            "finished_last_minute": len(window_requests),
            "ttft": percentiles([r["ttft"] for r in window_requests if r["ttft"] is not None]),
            "tpot": percentiles([r["tpot"] for r in window_requests if r["tpot"] is not None]),
        }
        msg = {"now": now, "steps": steps, "finished": finished, "active": active, "stats": stats}
        if first:
            msg["config"] = {"model": self.engine.served_model_name, "max_num_seqs": self.engine.config.max_num_seqs,
                             "block_size": self.engine.config.block_size, "step_fields": STEP_FIELDS,
                             "window_s": WINDOW_S}
        return msg

    async def kv_map(self) -> str:
        """The KV block map of every engine ('0' free, '1' prefix-cached, '2' used, '3' shared), shared by all
        pages, refreshed at most once a second and never more often than keeps its cost in the engine under
        KV_MAP_BUDGET of its time (a large cache is refreshed less often)."""
        now = time.monotonic()
        if now - self._kv_map_at >= self._kv_map_interval and self.engine.is_alive:
            self._kv_map_at = now
            try:
                maps = await asyncio.to_thread(lambda: [self.engine.call_core("kv_block_map", rank=r)
                                                        for r in range(len(self.engine.processes))])
                took = sum(seconds for _, seconds in maps)            # the engines' own time on it
                self.engine_s += took
                self._kv_map_interval = max(KV_MAP_INTERVAL_S, took / KV_MAP_BUDGET)
                t0 = time.thread_time()
                self._kv_map = "".join(m.translate(KV_CHARS).decode("ascii") for m, _ in maps)
                self.frontend_s += time.thread_time() - t0
            except Exception as e:  # noqa: BLE001 - the engine went away: keep the last map
                logger.debug("kv block map: %s", e)
        return self._kv_map

    async def events(self):
        self.clients += 1
        step_cursor = request_cursor = 0
        first = True
        try:
            while True:
                t0 = time.thread_time()
                msg = self.message(step_cursor, request_cursor, first)
                self.frontend_s += time.thread_time() - t0
                msg["kv_map"] = await self.kv_map()
                t0 = time.thread_time()
                if msg["steps"]:
                    step_cursor = msg["steps"][-1][0]
                else:
                    step_cursor = max(step_cursor, self._step_seq if first else step_cursor)
                if msg["finished"]:
                    request_cursor = msg["finished"][-1]["seq"]
                elif first:
                    request_cursor = self._request_seq
                first = False
                self.messages_sent += 1
                msg["cost"] = self.cost()
                data = f"data: {json.dumps(msg, separators=(',', ':'))}\n\n"
                yield data          # the server sends it (without waiting on the client) before asking for more
                self.frontend_s += time.thread_time() - t0
                await asyncio.sleep(INTERVAL_S)
        finally:
            self.clients -= 1


KV_CHARS = bytes.maketrans(bytes(range(4)), b"0123")


def _newest_while(ring: deque, keep):
    """The ring's entries from the newest back, while `keep` holds."""
    for item in reversed(ring):
        if not keep(item):
            return
        yield item


def request_entry(stream, finished: bool) -> dict:
    """One request's lane: its phases' times (wall clock) and numbers. TTFT/TPOT as vLLM defines them."""
    state = stream.state
    c = state.choices[0]
    t = c.timings
    tokens = len(t.token_times)
    entry = {
        "id": state.request_id, "arrival": t.arrival, "queued": t.queued, "scheduled": t.scheduled,
        "first_token": t.first_token, "end": (t.finished or t.last_token or time.time()) if finished else None,
        "prompt_tokens": state.num_prompt_tokens, "cached_tokens": state.num_cached_tokens,
        "output_tokens": state.num_completion_tokens, "n": len(state.choices), "priority": stream.priority,
        "preemptions": sum(x.timings.num_preemptions for x in state.choices),
        "ttft": None if t.first_token is None else round(t.first_token - t.arrival, 6),
        "tpot": round((t.last_token - t.first_token) / (tokens - 1), 6) if tokens > 1 else None,
    }
    if finished and stream.error:
        entry["error"] = stream.error
    return entry


_PAGE: str | None = None


def page() -> str:
    global _PAGE
    if _PAGE is None:
        _PAGE = (Path(__file__).parent / "static" / "dashboard.html").read_text(encoding="utf-8")
    return _PAGE


def dashboard_router(hub: DashboardHub) -> APIRouter:
    router = APIRouter()

    @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard_page():
        return HTMLResponse(page())

    @router.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events():
        return StreamingResponse(hub.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router
