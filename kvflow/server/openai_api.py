"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI)."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvflow
from kvflow.async_engine import (AsyncEngine, CompletionDelta, EngineDeadError, EngineOverloadedError,
                                 EngineShutdownError, RequestFailedError, RequestStream)
from kvflow.metrics import CONTENT_TYPE_LATEST
from kvflow.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    ModelCard, ModelList, TokenizeRequest, random_id, usage_dict)

logger = logging.getLogger("kvflow.server")

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class _AuthAndArrival:
    """Pure ASGI middleware: stamp the arrival time, check the API key on the OpenAI routes."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival_time"] = time.time()
            if self.api_key is not None and scope["path"].startswith(PROTECTED_PREFIXES) \
                    and scope.get("method") != "OPTIONS":
                auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
                if auth != f"Bearer {self.api_key}":
                    err = APIError(401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'",
                                   type="invalid_request_error", code="invalid_api_key")
                    resp = JSONResponse(err.body(), status_code=401)
                    await resp(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class _EventStream(StreamingResponse):
    """SSE response that closes (aborts) its request streams however it ends, even if never iterated."""

    def __init__(self, content, streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.close()


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


def _validation_param(loc) -> str | None:
    parts = [str(x) for x in loc if x not in ("body", "query", "path")]
    # drop pydantic's union-branch names ("str", "list[int]") that follow the field
    keep = []
    for p in parts:
        if p in ("str", "int", "float", "bool") or p.startswith(("list[", "dict[", "function-")):
            continue
        keep.append(p)
    return ".".join(keep) or None


def build_app(engine: AsyncEngine, *, api_key: str | None = None, served_model_names: list[str] | None = None,
              shutdown_grace_period: float = 30.0) -> FastAPI:
    names = served_model_names or [engine.served_model_name]
    tokenizer = engine.tokenizer
    vocab_size = getattr(getattr(engine.core, "model_config", None), "vocab_size", None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.shutdown(shutdown_grace_period)

    app = FastAPI(title="kvflow", version=kvflow.__version__ if hasattr(kvflow, "__version__") else "0",
                  lifespan=lifespan)
    app.state.engine = engine

    # ---- errors in OpenAI's shape ------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
            return _error_response(APIError(400, msg, param=None))
        param = _validation_param(first.get("loc", ()))
        msgs = []
        for e in errors[:5]:
            p = _validation_param(e.get("loc", ()))
            msgs.append(f"{p}: {e.get('msg')}" if p else str(e.get("msg")))
        return _error_response(APIError(400, "; ".join(msgs) or "invalid request", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception):
        logger.exception("internal error")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="internal_error"))

    # ---- helpers -----------------------------------------------------------------------------------------------
    def check_model(model: str | None) -> str:
        if model is None or model == "":
            return names[0]
        if model not in names:
            raise APIError(404, f"The model `{model}` does not exist. Served models: {', '.join(names)}",
                           type="invalid_request_error", param="model", code="model_not_found")
        return model

    def submit(request_id: str, prompt_ids: list[int], params, arrival: float) -> RequestStream:
        try:
            return engine.submit(request_id, prompt_ids, params, arrival_time=arrival)
        except EngineOverloadedError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except (EngineShutdownError, EngineDeadError) as e:
            raise APIError(503, str(e), type="service_unavailable", code="service_unavailable") from None
        except ValueError as e:
            raise APIError(400, str(e), param="messages" if "messages" in str(e) else None,
                           code="context_length_exceeded" if "context length" in str(e) else None) from None

    def check_token_ids(ids: list[int], param: str) -> None:
        if vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is out of range [0, {vocab_size})", param=param)

    def token_str(tid: int) -> str:
        return tokenizer.id_to_piece(tid) if tokenizer is not None else str(tid)

    def chat_logprobs(delta: CompletionDelta, top_n: int) -> list[dict]:
        out = []
        for tid, lps in zip(delta.token_ids, delta.logprobs or []):
            tok = token_str(tid)
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
            entries = []
            for t, lp in top:
                s = token_str(t)
                entries.append({"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))})
            out.append({"token": tok, "logprob": _finite(lps.get(tid, float("-inf"))),
                        "bytes": list(tok.encode("utf-8")), "top_logprobs": entries})
        return out

    def completion_logprobs(delta: CompletionDelta, top_n: int, offset: int) -> dict:
        res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lps in zip(delta.token_ids, delta.logprobs or []):
            tok = token_str(tid)
            res["tokens"].append(tok)
            res["token_logprobs"].append(_finite(lps.get(tid, float("-inf"))))
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
            res["top_logprobs"].append({token_str(t): _finite(lp) for t, lp in top} if top_n else None)
            res["text_offset"].append(offset)
            offset += len(tok)
        return res

    async def collect(streams: list[RequestStream], raw: Request) -> list[dict]:
        """Run streams to the end (aborting them if the client goes away); per choice: text, tokens, logprobs."""
        n = streams[0].params.n if streams else 1
        results: list[dict] = [{"text": "", "deltas": [], "finish_reason": None, "stop_reason": None}
                               for _ in range(len(streams) * n)]

        async def run():
            async for k, d in merge(streams):
                r = results[k * n + d.index]
                r["text"] += d.text
                r["deltas"].append(d)
                if d.finish_reason is not None:
                    r["finish_reason"], r["stop_reason"] = d.finish_reason, d.stop_reason

        await run_unless_disconnected(run(), raw, streams)
        return results

    def usage_of(streams: list[RequestStream]) -> dict:
        return usage_dict(sum(s.num_prompt_tokens for s in streams),
                          sum(s.num_completion_tokens for s in streams),
                          sum(s.num_cached_tokens for s in streams))

    def failure(e: RequestFailedError) -> APIError:
        if isinstance(e, EngineDeadError):
            return APIError(503, str(e), type="service_unavailable", code="engine_dead")
        return APIError(500, str(e), type="internal_error")

    # ---- OpenAI routes -----------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def list_models():
        cards = [ModelCard(id=name, root=str(getattr(engine.core, "model_path", name)),
                           max_model_len=engine.max_model_len) for name in names]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
        arrival = raw.scope.get("state", {}).get("arrival_time", time.time())
        model = check_model(req.model)
        params = req.to_sampling_params()
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        try:
            prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt))
        except APIError:
            raise
        except Exception as e:  # a template that rejects the conversation (roles out of order, ...)
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        request_id = random_id("chatcmpl")
        stream = submit(request_id, prompt_ids, params, arrival)
        created = int(time.time())
        top_n = req.top_logprobs or 0
        want_logprobs = bool(req.logprobs)
        if req.stream:
            return _EventStream(
                chat_sse(stream, request_id, created, model, want_logprobs, top_n, req.include_usage,
                         bool(req.stream_options and req.stream_options.continuous_usage_stats)), [stream])
        try:
            results = await collect([stream], raw)
        except RequestFailedError as e:
            raise failure(e) from None
        choices = []
        for i, r in enumerate(results):
            lp = None
            if want_logprobs:
                content = []
                for d in r["deltas"]:
                    content.extend(chat_logprobs(d, top_n))
                lp = {"content": content}
            choices.append({"index": i, "message": {"role": "assistant", "content": r["text"]}, "logprobs": lp,
                            "finish_reason": r["finish_reason"], "stop_reason": r["stop_reason"]})
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage_of([stream]), "system_fingerprint": None}

    async def chat_sse(stream: RequestStream, request_id: str, created: int, model: str, want_logprobs: bool,
                       top_n: int, include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
        chunk = functools.partial(sse_chunk, {"id": request_id, "object": "chat.completion.chunk",
                                               "created": created, "model": model}, include_usage=include_usage)

        try:
            for i in range(stream.params.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for d in stream:
                if not d.text and d.finish_reason is None and not (want_logprobs and d.token_ids):
                    continue
                delta = {"content": d.text} if d.text else {}
                choice = {"index": d.index, "delta": delta,
                          "logprobs": {"content": chat_logprobs(d, top_n)} if want_logprobs else None,
                          "finish_reason": d.finish_reason}
                if d.finish_reason is not None:
                    choice["stop_reason"] = d.stop_reason
                yield chunk([choice], usage_of([stream]) if continuous_usage else None)
            if include_usage:
                yield chunk([], usage_of([stream]))
        except RequestFailedError as e:
            yield f"data: {json.dumps(failure(e).body())}\n\n"
        finally:
            stream.close()
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request):
        arrival = raw.scope.get("state", {}).get("arrival_time", time.time())
        model = check_model(req.model)
        params = req.to_sampling_params()
        prompts = req.prompts()
        token_prompts = []
        for p in prompts:
            if isinstance(p, str):
                token_prompts.append(list(tokenizer.encode(p)))
            else:
                check_token_ids(p, "prompt")
                token_prompts.append(list(p))
        request_id = random_id("cmpl")
        streams: list[RequestStream] = []
        try:
            for k, ids in enumerate(token_prompts):
                rid = request_id if len(token_prompts) == 1 else f"{request_id}-p{k}"
                streams.append(submit(rid, ids, params, arrival))
        except APIError:
            for s in streams:
                s.close()
            raise
        created = int(time.time())
        top_n = req.logprobs or 0
        want_logprobs = req.logprobs is not None
        if req.stream:
            return _EventStream(
                completion_sse(streams, request_id, created, model, want_logprobs, top_n, req.include_usage),
                streams)
        try:
            results = await collect(streams, raw)
        except RequestFailedError as e:
            raise failure(e) from None
        choices = []
        for i, r in enumerate(results):
            lp = None
            if want_logprobs:
                lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                offset = 0
                for d in r["deltas"]:
                    part = completion_logprobs(d, top_n, offset)
                    for key in lp:
                        lp[key].extend(part[key])
                    offset += sum(len(t) for t in part["tokens"])
            choices.append({"index": i, "text": r["text"], "logprobs": lp, "finish_reason": r["finish_reason"],
                            "stop_reason": r["stop_reason"]})
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage_of(streams), "system_fingerprint": None}

    async def completion_sse(streams: list[RequestStream], request_id: str, created: int, model: str,
                             want_logprobs: bool, top_n: int, include_usage: bool) -> AsyncIterator[str]:
        n = streams[0].params.n
        offsets = [0] * (len(streams) * n)

        chunk = functools.partial(sse_chunk, {"id": request_id, "object": "text_completion",
                                               "created": created, "model": model}, include_usage=include_usage)

        try:
            async for k, d in merge(streams):
                if not d.text and d.finish_reason is None and not (want_logprobs and d.token_ids):
                    continue
                index = k * n + d.index
                lp = None
                if want_logprobs:
                    lp = completion_logprobs(d, top_n, offsets[index])
                    offsets[index] += sum(len(t) for t in lp["tokens"])
                choice = {"index": index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
                if d.finish_reason is not None:
                    choice["stop_reason"] = d.stop_reason
                yield chunk([choice])
            if include_usage:
                yield chunk([], usage_of(streams))
        except RequestFailedError as e:
            yield f"data: {json.dumps(failure(e).body())}\n\n"
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"

    # ---- vLLM's extra routes -----------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if engine.is_alive:
            return Response(status_code=200)
        return _error_response(APIError(503, engine._dead or "the engine loop is not running",
                                        type="service_unavailable", code="engine_dead"))

    @app.get("/version")
    async def version():
        return {"version": getattr(kvflow, "__version__", "0.1.0")}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                ids = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt))
            except Exception as e:
                raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        check_token_ids(req.tokens, "tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    app.add_middleware(_AuthAndArrival, api_key=api_key)
    return app


def sse_chunk(head: dict, choices: list, usage: Any = None, *, include_usage: bool) -> str:
    """One Server-Sent Event carrying a chunk object; `usage` appears (null until the last chunk) when asked."""
    body = {**head, "system_fingerprint": None, "choices": choices}
    if include_usage:
        body["usage"] = usage
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number
    return max(float(x), -9999.0)


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, CompletionDelta]]:
    """Interleave several request streams as (stream index, delta)."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, s: RequestStream):
        try:
            async for d in s:
                await queue.put((k, d))
        except BaseException as e:  # noqa: BLE001
            await queue.put((k, e))
            return
        await queue.put((k, done))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            k, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def run_unless_disconnected(coro, raw: Request, streams: list[RequestStream]):
    """Await `coro`; if the HTTP client disconnects first, cancel it (which aborts the streams)."""
    task = asyncio.ensure_future(coro)

    async def wait_disconnect():
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        for s in streams:
            s.close()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    for s in streams:
        s.close()
    with contextlib.suppress(BaseException):
        await task
    raise APIError(499, "client disconnected", type="client_closed_request")
