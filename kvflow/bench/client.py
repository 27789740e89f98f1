"""One streamed request to an OpenAI-compatible server, timed token by token.

Times are taken with time.perf_counter() at the moment each SSE event is parsed. A chunk can carry several
tokens (a server that batches its output, or a detokenizer that holds text back); when the server reports the
real number of output tokens in `usage`, the tokens are shared out over the content chunks in proportion to their
text (at least one each), and the tokens of one chunk are spread evenly over the gap since the previous chunk, so
inter-token latency is per token, not per chunk. The first chunk's tokens all count as arriving at TTFT. With that,
the inter-token latencies of a request sum to E2E-to-last-token minus TTFT, and their mean is its TPOT.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field, replace

import httpx

from kvflow.bench.workloads import RequestSpec

# error kinds (besides "http_<status>")
TIMEOUT = "timeout"
BROKEN_STREAM = "broken_stream"      # connection dropped, stream cut before its end, or unparsable event
STREAM_ERROR = "stream_error"        # the server sent an error object inside the stream
CONNECT_ERROR = "connect_error"
CLIENT_ERROR = "client_error"        # anything else the client could not make sense of


@dataclass
class RequestRecord:
    index: int
    send_time: float                 # seconds since the run started
    success: bool = False
    ttft: float | None = None        # seconds from send to the first content token
    e2e: float | None = None         # seconds from send to the end of the stream
    token_times: list[float] = field(default_factory=list)   # each output token's arrival, seconds from send
    num_chunks: int = 0
    prompt_tokens: int | None = None
    output_tokens: int = 0
    usage_reported: bool = False
    finish_reason: str | None = None
    error_kind: str | None = None
    error: str | None = None
    max_tokens: int | None = None
    group: str | None = None
    output_text: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last token time − TTFT) / (output tokens − 1)."""
        if not self.success or self.ttft is None or self.output_tokens < 2 or not self.token_times:
            return None
        return (self.token_times[-1] - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def as_saved(self) -> RequestRecord:
        """This record as results.json keeps it (token times to the microsecond): what a record read back has."""
        return replace(self, token_times=[round(x, 6) for x in self.token_times])

    def to_json(self, keep_text: bool = False) -> dict:
        d = asdict(self)
        d["token_times"] = self.as_saved().token_times
        d["tpot"] = self.tpot                # from the measured token times
        if not keep_text:
            d.pop("output_text")
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RequestRecord":
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in names})


def split_tokens(chunk_texts: list[str], total: int) -> list[int]:
    """Share `total` tokens over the chunks: one each, the rest in proportion to text length (largest
    remainder). When the server reports fewer tokens than chunks, each chunk counts one."""
    n = len(chunk_texts)
    if n == 0:
        return []
    if total <= n:
        return [1] * n
    extra = total - n
    weights = [max(len(t), 1) for t in chunk_texts]
    wsum = sum(weights)
    shares = [extra * w / wsum for w in weights]
    counts = [int(s) for s in shares]
    left = extra - sum(counts)
    for i in sorted(range(n), key=lambda i: (-(shares[i] - counts[i]), i))[:left]:
        counts[i] += 1
    return [1 + c for c in counts]


def spread_token_times(chunk_times: list[float], counts: list[int]) -> list[float]:
    """Arrival time of every token: chunk 0's tokens at its time; chunk j's k tokens evenly over
    (t[j-1], t[j]], the last one at t[j]."""
    out: list[float] = []
    for j, (t, k) in enumerate(zip(chunk_times, counts)):
        if j == 0:
            out.extend([t] * k)
        else:
            prev = chunk_times[j - 1]
            out.extend(prev + (t - prev) * (i + 1) / k for i in range(k))
    return out


def build_body(api: str, model: str, spec: RequestSpec, *, ignore_eos: bool, temperature: float | None,
               extra_body: dict | None) -> dict:
    body: dict = {"model": spec.model or model, "stream": True, "stream_options": {"include_usage": True}}
    if api == "chat":
        body["messages"] = spec.as_messages()
    else:
        body["prompt"] = spec.as_prompt()
    if spec.max_tokens is not None:
        body["max_tokens"] = spec.max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if ignore_eos:
        body["ignore_eos"] = True        # vLLM's (and llama.cpp's, SGLang's) extra field
    if extra_body:
        body.update(extra_body)
    return body


def _content_of(api: str, choice: dict) -> str:
    if api == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, url: str, api: str, body: dict, spec: RequestSpec,
                       t_zero: float, timeout: float, keep_text: bool = False) -> RequestRecord:
    """Send one streaming request and time it; never raises for the server's faults."""
    t_send = time.perf_counter()
    rec = RequestRecord(index=spec.index, send_time=t_send - t_zero, max_tokens=spec.max_tokens, group=spec.group)
    chunk_times: list[float] = []
    chunk_texts: list[str] = []
    usage: dict | None = None
    done = False
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    rec.error_kind, rec.error = f"http_{resp.status_code}", _error_message(text)
                    rec.e2e = time.perf_counter() - t_send
                    return rec
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        event = json.loads(data)
                    except json.JSONDecodeError:
                        rec.error_kind, rec.error = BROKEN_STREAM, f"unparsable event: {data[:200]!r}"
                        break
                    if "error" in event and not event.get("choices"):
                        rec.error_kind, rec.error = STREAM_ERROR, _error_message(json.dumps(event))
                        break
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices") or []:
                        text = _content_of(api, choice)
                        if text:
                            chunk_times.append(now - t_send)
                            chunk_texts.append(text)
                        if choice.get("finish_reason"):
                            rec.finish_reason = choice["finish_reason"]
                end = time.perf_counter()
    except (TimeoutError, httpx.TimeoutException) as e:
        rec.error_kind, rec.error = TIMEOUT, f"no complete answer within the timeout ({type(e).__name__})"
    except httpx.ConnectError as e:
        rec.error_kind, rec.error = CONNECT_ERROR, str(e) or type(e).__name__
    except (httpx.TransportError, httpx.StreamError, httpx.DecodingError) as e:   # RemoteProtocolError, ReadError..
        rec.error_kind, rec.error = BROKEN_STREAM, f"{type(e).__name__}: {e}"
    except Exception as e:   # noqa: BLE001 - an odd answer must fail this request, never the whole run
        rec.error_kind, rec.error = CLIENT_ERROR, f"{type(e).__name__}: {e}"[:500]
    if rec.error_kind is None and not done and rec.finish_reason is None:
        rec.error_kind, rec.error = BROKEN_STREAM, "the stream ended without [DONE] or a finish_reason"
    rec.e2e = (end if rec.error_kind is None else time.perf_counter()) - t_send
    rec.num_chunks = len(chunk_times)
    if keep_text:
        rec.output_text = "".join(chunk_texts)
    if usage:
        rec.usage_reported = True
        rec.prompt_tokens = usage.get("prompt_tokens")
        total = usage.get("completion_tokens")
    else:
        total = None
    if rec.prompt_tokens is None:
        rec.prompt_tokens = spec.prompt_tokens_est
    counts = split_tokens(chunk_texts, total if total is not None else len(chunk_texts))
    rec.token_times = spread_token_times(chunk_times, counts)
    rec.output_tokens = total if total is not None else len(rec.token_times)
    if chunk_times:
        rec.ttft = chunk_times[0]
    rec.success = rec.error_kind is None
    return rec


def _error_message(text: str) -> str:
    try:
        obj = json.loads(text)
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:500]
        return str(err)[:500]
    except (json.JSONDecodeError, AttributeError):
        return text[:500]
