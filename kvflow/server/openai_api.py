"""The FastAPI app: routes onto OpenAIServing's methods, errors in OpenAI's shape, an OpenAPI document that
says what the server does (400 for invalid requests, the value limits, /health and /metrics' content types).

Every error a request's data can cause is an APIError or InvalidRequestError (400 with its `param`), a
RequestValidationError (400) or an HTTPException; the catch-all handler is only for the server's own bugs.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow import __version__
from kvflow.async_engine import AsyncEngine
from kvflow.errors import InvalidRequestError
from kvflow.metrics import CONTENT_TYPE_LATEST
from kvflow.server.batch_store import StoreHandle
from kvflow.server.batch_worker import BatchWorker
from kvflow.server.batches_api import batches_router
from kvflow.server.config import ServerConfig
from kvflow.server.dashboard import DashboardHub, dashboard_router
from kvflow.server.embeddings_api import EMBEDDINGS_OPENAPI, EmbeddingRequest, EmbeddingsServing
from kvflow.server.files_api import MULTIPART_SLACK, files_router
from kvflow.server.middleware import AuthAndArrival, BodySizeLimit
from kvflow.server.messages_api import messages_router
from kvflow.server.protocol import (APIError, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                    CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                                    ModelList, TokenizeRequest, TokenizeResponse, TokenizerInfoResponse,
                                    validation_error)
from kvflow.server.request_record import OpenRecords, RequestObserver
from kvflow.server.serving import OpenAIServing
from kvflow.server.responses_api import RESPONSES_OPENAPI, ResponsesServing
from kvflow.server.responses_protocol import ResponsesRequest

logger = logging.getLogger("kvflow.server")


def _errors(*codes: int) -> dict:
    return {c: {"model": ErrorResponse, "description": DESCRIPTIONS[c]} for c in codes}


DESCRIPTIONS = {400: "invalid request (the error's `param` names the field)", 401: "missing or wrong API key",
                404: "unknown model", 413: "request body larger than --max-request-body-size",
                429: "queue full (--max-queue-len): retry after Retry-After seconds",
                500: "the engine failed on this request", 503: "the engine died or the server is shutting down"}
GENERATE_ERRORS = _errors(400, 401, 404, 413, 429, 500, 503)
HEALTH_RESPONSES = {200: {"description": "the server can serve (empty body)", "content": None}, **_errors(503)}
# /invocations reads its body itself (it is one of two requests): the document says which
INVOCATION_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"oneOf": [
    {"$ref": "#/components/schemas/ChatCompletionRequest"}, {"$ref": "#/components/schemas/CompletionRequest"}]}}}}}


def _streamed_or(model) -> dict:
    return {200: {"model": model, "description": "the response, or with `stream: true` Server-Sent Events of "
                                                 "chunks ending with `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def build_engine(config, server: ServerConfig) -> AsyncEngine:
    return AsyncEngine.from_config(config, max_queue_len=server.max_queue_len, request_log=server.request_log,
                                   log_stats_interval=server.log_stats_interval,
                                   request_log_options=dict(max_bytes=server.request_log_max_bytes,
                                                            backup_count=server.request_log_backup_count,
                                                            model_version=server.model_version))


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    serving = OpenAIServing(engine, served_model_names=config.served_model_name, max_n=config.max_n,
                            shutdown_grace_period=config.shutdown_grace_period,
                            tool_call_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
                            trust_request_chat_template=config.trust_request_chat_template,
                            return_tokens_as_token_ids=config.return_tokens_as_token_ids)

    for name, path in config.lora_module_paths():     # --lora-modules: a bad adapter stops the start, naming it
        engine.add_lora(name, path)
    embeddings = EmbeddingsServing(serving)     # pooled hidden states: prefill-only requests in the same batch
    # the Batch API: its store opens on first use; its worker resumes what a store found at start holds
    batch_store = StoreHandle(config.batch_dir)
    batch_worker = BatchWorker(batch_store, serving, embeddings, engine.metrics,
                               max_concurrency=config.batch_max_concurrency or default_batch_concurrency(engine),
                               priority=config.batch_priority)

    # the request log's and the traces' record of each generate request (server/request_record.py); the tracer and
    # OpenTelemetry are imported only when traces are on
    sinks = []
    if engine.request_log is not None:
        sinks.append(lambda line, _record: engine.request_log.write(line))
    tracer = None
    if config.otlp_traces_endpoint:
        from kvflow.server.tracing import Tracer
        tracer = Tracer(config.otlp_traces_endpoint, model_version=lambda: config.model_version or (
            engine.request_log.model_version if engine.request_log is not None else None))
        sinks.append(tracer.emit)
    dashboard = None if config.disable_dashboard else DashboardHub(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        batch_worker.start()
        yield
        batch_worker.pause()        # no new batch lines; those in flight finish within the grace period and commit
        await serving.shutdown_engine()
        await batch_worker.stop()
        if tracer is not None:      # export what is still queued
            await asyncio.to_thread(tracer.shutdown)

    app = FastAPI(title="kvflow", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.serving = serving
    app.state.batch_worker = batch_worker
    app.state.tracer = tracer
    app.state.open_records = OpenRecords()
    app.state.dashboard = dashboard

    # ---- errors in OpenAI's shape ------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(_request: Request, exc: InvalidRequestError):
        return error_response(APIError.bad_request(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind, code=code))

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception):   # a bug of ours, never a bad request
        logger.exception("internal error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="internal_error"))

    # ---- OpenAI routes -----------------------------------------------------------------------------------------
    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **_errors(401)})
    async def list_models():
        return serving.models()

    @app.post("/v1/embeddings", response_model=None, responses={**EMBEDDINGS_OPENAPI, **GENERATE_ERRORS})
    async def create_embedding(req: EmbeddingRequest, raw: Request):
        return await embeddings.create(req, raw)

    @app.post("/v1/chat/completions", response_model=None,
              responses={**_streamed_or(ChatCompletionResponse), **GENERATE_ERRORS})
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @app.post("/v1/completions", response_model=None,
              responses={**_streamed_or(CompletionResponse), **GENERATE_ERRORS})
    async def create_completion(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    responses = ResponsesServing(serving)     # OpenAI's Responses API, an adapter over the chat route

    @app.post("/v1/responses", response_model=None, responses={**RESPONSES_OPENAPI, **GENERATE_ERRORS})
    async def create_response(req: ResponsesRequest, raw: Request):
        return await responses.create(req, raw)

    app.include_router(messages_router(serving))   # Anthropic's Messages API: its route answers errors in their shape
    app.include_router(files_router(batch_store, config))                  # OpenAI's Files API, for batches
    app.include_router(batches_router(batch_store, batch_worker, config))  # OpenAI's Batch API
    if dashboard is not None:
        app.include_router(dashboard_router(dashboard))    # the live view of the batch: /dashboard

    # ---- vLLM's extra routes -----------------------------------------------------------------------------------
    def health_response(live: bool = False) -> Response:
        """/health: 200 when the server can serve (the engine alive and accepting: not draining), the readiness a
        load balancer or router needs; 503 naming why not (code engine_dead or draining). `live`: only whether the
        engine is alive, draining included (a liveness probe must not kill a server finishing its requests)."""
        if engine.is_accepting or (live and engine.is_alive):
            return Response(status_code=200)
        if engine.is_alive:
            return error_response(APIError(503, "the server is shutting down: it finishes the requests it has and "
                                                "takes no new ones", type="service_unavailable", code="draining"))
        return error_response(APIError(503, engine.death_reason or "the engine loop is not running",
                                       type="service_unavailable", code="engine_dead"))

    @app.get("/health", response_class=Response, responses=HEALTH_RESPONSES)
    async def health():
        return health_response()

    @app.get("/health/live", response_class=Response, responses=HEALTH_RESPONSES)
    async def health_live():
        """Liveness: the engine is alive (200 while draining too)."""
        return health_response(live=True)

    # ---- SageMaker's routes, as vLLM serves them -----------------------------------------------------------------
    @app.get("/ping", response_class=Response, responses=HEALTH_RESPONSES, operation_id="ping_get")
    @app.post("/ping", response_class=Response, responses=HEALTH_RESPONSES, operation_id="ping_post")
    async def ping():
        return health_response()

    @app.post("/invocations", response_model=None, openapi_extra=INVOCATION_BODY,
              responses={**_streamed_or(ChatCompletionResponse | CompletionResponse), **GENERATE_ERRORS})
    async def invocations(raw: Request):
        """A chat completion when the body has `messages`, else a completion when it has `prompt`."""
        try:
            body = json.loads(await raw.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        for key, model, route in (("messages", ChatCompletionRequest, serving.chat),
                                  ("prompt", CompletionRequest, serving.completions)):
            if key in body:
                try:
                    req = model.model_validate(body)
                except ValidationError as e:     # the route's own 400, as if sent there
                    raise RequestValidationError(e.errors()) from None
                return await route(req, raw)
        raise APIError(400, "an /invocations body needs `messages` (a chat completion) or `prompt` (a completion)",
                       param="messages")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", response_class=PrometheusText, responses={200: {"description": "Prometheus text format"}})
    async def metrics():
        return PrometheusText(engine.metrics.render())

    @app.post("/tokenize", response_model=None, responses={200: {"model": TokenizeResponse},
                                                           **_errors(400, 401, 404, 413)})
    async def tokenize(req: TokenizeRequest):
        return await serving.tokenize(req)

    @app.post("/detokenize", response_model=None, responses={200: {"model": DetokenizeResponse},
                                                             **_errors(400, 401, 404, 413)})
    async def detokenize(req: DetokenizeRequest):
        return await serving.detokenize(req)

    # LoRA adapters at run time (vLLM's routes): only with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING (or
    # KVFLOW_ALLOW_RUNTIME_LORA_UPDATING) true; otherwise 404, as vLLM answers
    if getattr(engine.config, "enable_lora", False) and runtime_lora_updating_allowed():
        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_errors(400, 401))
        async def load_lora_adapter(req: LoadLoRAAdapterRequest):
            # load_inplace (vLLM's): a name in use gets the new weights (a fresh id: requests already submitted
            # finish on the old ones); the old adapter stays if the new one is refused
            replaced = engine.loras.pop(req.lora_name, None) if req.load_inplace else None
            try:
                await asyncio.to_thread(_check_lora_path, req.lora_path)
                engine.add_lora(req.lora_name, req.lora_path)
            except ValueError as e:
                if replaced is not None:
                    engine.loras[req.lora_name] = replaced
                raise APIError(400, str(e), param="lora_path" if "path" in str(e) else "lora_name") from None
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_errors(400, 401))
        async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
            if req.lora_int_id is not None:       # ids are the server's own, fresh per load: unload by name
                raise APIError(400, "lora_int_id is not supported: unload the adapter by lora_name",
                               param="lora_int_id")
            try:
                engine.remove_lora(req.lora_name)
            except KeyError:
                raise APIError(400, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name",
                               code="model_not_found") from None
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    if config.enable_tokenizer_info_endpoint:    # off: 404, as vLLM answers
        @app.get("/tokenizer_info", response_model=None, responses={200: {"model": TokenizerInfoResponse},
                                                                    **_errors(401)})
        async def tokenizer_info():
            return serving.tokenizer_info()

    app.openapi = lambda: openapi_document(app, config.max_n)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_size,
                       uploads={"/v1/files": (config.max_batch_file_size + MULTIPART_SLACK, "--max-batch-file-size")})
    app.add_middleware(AuthAndArrival, api_key=config.api_key)
    if sinks:       # added last: runs first, so a 401 or a 413 gets its line too
        app.add_middleware(RequestObserver, sinks=sinks, log_prompts=config.request_log_prompts,
                           open_records=app.state.open_records)
    return app


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def runtime_lora_updating_allowed() -> bool:
    return any(os.environ.get(var, "").strip().lower() in ("1", "true", "yes")
               for var in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "KVFLOW_ALLOW_RUNTIME_LORA_UPDATING"))


def _check_lora_path(path: str) -> None:
    if not path or not os.path.isdir(os.path.expanduser(path)):
        raise ValueError(f"lora_path {path!r} is not a folder on the server (a PEFT adapter folder)")


class PrometheusText(PlainTextResponse):
    media_type = CONTENT_TYPE_LATEST


def default_batch_concurrency(engine: AsyncEngine) -> int:
    """Half of the engine's sequence slots (all engines' together), at least 1: the other half stays free for
    interactive requests, which the scheduler admits first anyway (batch lines run at --batch-priority)."""
    config = engine.config
    return max(1, config.max_num_seqs * config.data_parallel_size // 2)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


def openapi_document(app: FastAPI, max_n: int) -> dict:
    """FastAPI's document, corrected: invalid requests are 400s in OpenAI's error shape (not 422s), integer
    limits stay exact, and `n` shows this server's --max-n."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in doc["paths"].values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for model in (ChatCompletionRequest, CompletionRequest):
            exact = model.model_json_schema()["properties"]
            props = schemas[model.__name__]["properties"]
            for name, prop in props.items():   # FastAPI's OpenAPI model makes limits floats: 2**63-1 read as 2**63
                prop.update({k: v for k, v in exact[name].items() if k in ("minimum", "maximum")})
            props["n"]["maximum"] = max_n
        app.openapi_schema = doc
    return app.openapi_schema
