"""The app: one FastAPI application that mounts every surface's router, in OpenAI's error shape, with an OpenAPI
document that says what the server does (400 for invalid requests, the value limits, /health and /metrics' content
types). The surfaces (`openai/`, `embeddings/`, `score/`, `responses/`, `messages/`, `batch/`, `observe/`) never import one
another: what one needs of another (the Batch API's line routes, the Messages API's error shape at the edge) is
handed over here.

Every error a request's data can cause is an APIError or InvalidRequestError (400 with its `param`), a
RequestValidationError (400) or an HTTPException; the catch-all handler is only for the server's own bugs.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow import __version__
from kvflow.async_engine import AsyncEngine
from kvflow.errors import InvalidRequestError
from kvflow.server.batch.batches import batches_router
from kvflow.server.batch.files import MULTIPART_SLACK, files_router
from kvflow.server.batch.runner import LineRoutes
from kvflow.server.batch.store import StoreHandle
from kvflow.server.batch.worker import BatchWorker
from kvflow.server.common.config import ServerConfig
from kvflow.server.common.errors import APIError, error_response, validation_error
from kvflow.server.common.middleware import AuthAndArrival, BodySizeLimit, LoadCount, ServerLoad
from kvflow.server.common.request_record import GENERATE_PATHS, OpenRecords, RequestObserver
from kvflow.server.embeddings.protocol import EmbeddingRequest
from kvflow.server.embeddings.routes import EmbeddingsServing, embeddings_router
from kvflow.server.score.routes import ScoreServing, score_router
from kvflow.server.messages import routes as messages
from kvflow.server.messages.protocol import MESSAGES_PATH
from kvflow.server.observe.dashboard import DashboardHub, dashboard_router
from kvflow.server.observe.health import health_router
from kvflow.server.openai.routes import openai_router
from kvflow.server.responses.routes import responses_router
from kvflow.server.observe.sleep import sleep_router
from kvflow.server.serving.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.server.serving.serving import OpenAIServing

logger = logging.getLogger("kvflow.server")


def build_engine(config, server: ServerConfig) -> AsyncEngine:
    return AsyncEngine.from_config(config, max_queue_len=server.max_queue_len, request_log=server.request_log,
                                   log_stats_interval=server.log_stats_interval,
                                   sleep_idle_seconds=server.sleep_idle_seconds,
                                   request_log_options=dict(max_bytes=server.request_log_max_bytes,
                                                            backup_count=server.request_log_backup_count,
                                                            model_version=server.model_version))


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    serving = OpenAIServing(engine, served_model_names=config.served_model_name, max_n=config.max_n,
                            shutdown_grace_period=config.shutdown_grace_period,
                            tool_call_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
                            trust_request_chat_template=config.trust_request_chat_template,
                            return_tokens_as_token_ids=config.return_tokens_as_token_ids,
                            reasoning_parser=config.reasoning_parser,
                            reasoning_budget_message=config.reasoning_budget_message,
                            enable_per_request_metrics=config.enable_per_request_metrics,
                            sse_ping_interval=config.sse_ping_interval if config.sse_ping_interval > 0 else None)
    if config.chat_template is not None:      # --chat-template: the server's chats render with it, /tokenize too
        engine.tokenizer.hf.chat_template = config.chat_template_text()

    for name, path in config.lora_module_paths():     # --lora-modules: a bad adapter stops the start, naming it
        engine.add_lora(name, path)
    embeddings = EmbeddingsServing(serving)     # pooled hidden states: prefill-only requests in the same batch
    # the Batch API: its store opens on first use; its worker resumes what a store found at start holds
    batch_store = StoreHandle(config.batch_dir)
    batch_worker = BatchWorker(batch_store, serving, batch_line_routes(serving, embeddings), engine.metrics,
                               max_concurrency=config.batch_max_concurrency or default_batch_concurrency(engine),
                               priority=config.batch_priority)

    # the request log's and the traces' record of each generate request (common/request_record.py); the tracer and
    # OpenTelemetry are imported only when traces are on
    sinks = []
    if engine.request_log is not None:
        sinks.append(lambda line, _record: engine.request_log.write(line))
    tracer = None
    if config.otlp_traces_endpoint:
        from kvflow.server.observe.tracing import Tracer
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

    # ---- the surfaces -------------------------------------------------------------------------------------------
    app.include_router(openai_router(serving, config))      # chat, completions, /invocations, tokenize, LoRA routes
    app.include_router(embeddings_router(embeddings))
    app.include_router(score_router(ScoreServing(serving)))
    app.include_router(responses_router(serving))           # OpenAI's Responses API, an adapter over the chat route
    app.include_router(messages.messages_router(serving))   # Anthropic's Messages API: errors in its own shape
    app.include_router(files_router(batch_store, config))                  # OpenAI's Files API, for batches
    app.include_router(batches_router(batch_store, batch_worker, config))  # OpenAI's Batch API
    app.state.server_load = LoadCount()
    app.include_router(health_router(engine, app.state.server_load))   # /health, /ping, /load, /version, /metrics
    if dashboard is not None:
        app.include_router(dashboard_router(dashboard))    # the live view of the batch: /dashboard
    if getattr(engine.config, "enable_sleep_mode", False):
        app.include_router(sleep_router(engine))           # vLLM's /sleep, /wake_up, /is_sleeping

    app.openapi = lambda: openapi_document(app, config.max_n)
    error_shapes = {MESSAGES_PATH: messages.error_body}     # the edge's 401 and 413 in each surface's shape
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_size,
                       uploads={"/v1/files": (config.max_batch_file_size + MULTIPART_SLACK, "--max-batch-file-size")},
                       error_shapes=error_shapes)
    if config.enable_server_load_tracking:     # inside the key check: a 401 is no load
        app.add_middleware(ServerLoad, paths=GENERATE_PATHS, load=app.state.server_load)
    app.add_middleware(AuthAndArrival, api_key=config.api_key, error_shapes=error_shapes)
    if sinks:       # added last: runs first, so a 401 or a 413 gets its line too
        app.add_middleware(RequestObserver, sinks=sinks, log_prompts=config.request_log_prompts,
                           open_records=app.state.open_records)
    if config.allowed_origins is not None:     # outermost: a 401 or a 413 carries the CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods or ["*"]),
                           allow_headers=list(config.allowed_headers or ["*"]),
                           allow_credentials=config.allow_credentials)
    return app


def batch_line_routes(serving: OpenAIServing, embeddings: EmbeddingsServing) -> LineRoutes:
    """What a batch line's `url` runs: the route's request model and method (the Batch API and `kvflow run-batch`)."""
    return {"/v1/chat/completions": (ChatCompletionRequest, serving.chat),
            "/v1/completions": (CompletionRequest, serving.completions),
            "/v1/embeddings": (EmbeddingRequest, embeddings.create)}


def default_batch_concurrency(engine: AsyncEngine) -> int:
    """Half of the engine's sequence slots (all engines' together), at least 1: the other half stays free for
    interactive requests, which the scheduler admits first anyway (batch lines run at --batch-priority)."""
    config = engine.config
    return max(1, config.max_num_seqs * config.data_parallel_size // 2)


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
