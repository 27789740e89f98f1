"""The operator's routes: /health (readiness: 200 only while the engine is alive and accepting, 503 `draining`
during a shutdown or `engine_dead` after a death: what a load balancer or vllm-router needs), /health/live
(liveness: alive, draining included), SageMaker's /ping (= /health), /load (vLLM's server load), /version and
/metrics (Prometheus text)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from kvflow import __version__
from kvflow.async_engine import AsyncEngine
from kvflow.metrics import CONTENT_TYPE_LATEST
from kvflow.server.common.errors import APIError, error_response, error_responses
from kvflow.server.common.middleware import LoadCount

HEALTH_RESPONSES = {200: {"description": "the server can serve (empty body)", "content": None},
                    **error_responses(503)}


class PrometheusText(PlainTextResponse):
    media_type = CONTENT_TYPE_LATEST


def health_router(engine: AsyncEngine, load: LoadCount) -> APIRouter:
    """`load`: the server load /load reports (counted by the ServerLoad middleware when it is on)."""
    router = APIRouter()

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

    @router.get("/health", response_class=Response, responses=HEALTH_RESPONSES)
    async def health():
        return health_response()

    @router.get("/health/live", response_class=Response, responses=HEALTH_RESPONSES)
    async def health_live():
        """Liveness: the engine is alive (200 while draining too)."""
        return health_response(live=True)

    # SageMaker's health route, as vLLM serves it
    @router.get("/ping", response_class=Response, responses=HEALTH_RESPONSES, operation_id="ping_get")
    @router.post("/ping", response_class=Response, responses=HEALTH_RESPONSES, operation_id="ping_post")
    async def ping():
        return health_response()

    @router.get("/load")
    async def server_load() -> dict[str, int]:
        """vLLM's: the requests in flight on the routes that run the model (0 without --enable-server-load-tracking)."""
        return {"server_load": load.count}

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.get("/metrics", response_class=PrometheusText, responses={200: {"description": "Prometheus text format"}})
    async def metrics():
        return PrometheusText(engine.metrics.render())

    return router
