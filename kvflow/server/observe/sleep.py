"""vLLM's sleep-mode routes, mounted only with --enable-sleep-mode (vLLM mounts them in dev mode,
VLLM_SERVER_DEV_MODE=1, on an engine started with --enable-sleep-mode; elsewhere they are 404s):

    POST /sleep?level=1|2&mode=wait|abort   200 once the engine sleeps (level 1: the KV cache released; level 2:
                                            the weights too); requests sent meanwhile get 503 + Retry-After
    POST /wake_up[?tags=weights&tags=kv_cache]   200 once what the tags name is back (no tags: everything)
    GET  /is_sleeping                       {"is_sleeping": bool}

`mode` is vLLM's, with kvflow's default: "wait" lets the requests in flight finish (none is cut), "abort" ends them
(vLLM's default); vLLM's "keep" is refused by name. An unknown query parameter is a 400 naming it.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvflow.async_engine import AsyncEngine, EngineDeadError, EngineShutdownError
from kvflow.errors import InvalidRequestError
from kvflow.server.common.errors import APIError

SLEEP_PARAMS = ("level", "mode")
WAKE_UP_PARAMS = ("tags",)


def _check_params(request: Request, known: tuple[str, ...]) -> None:
    for name in request.query_params:
        if name not in known:
            raise InvalidRequestError(f"unknown query parameter {name!r} (this route takes {', '.join(known)})",
                                      param=name, code="unknown_parameter")


def sleep_router(engine: AsyncEngine) -> APIRouter:
    router = APIRouter()

    @router.post("/sleep", response_class=Response, responses={200: {"description": "the engine sleeps"}})
    async def sleep(request: Request) -> Response:
        _check_params(request, SLEEP_PARAMS)
        text = request.query_params.get("level", "1")
        try:
            level = int(text)
        except ValueError:
            raise InvalidRequestError(f"level must be 1 or 2, got {text!r}", param="level",
                                      code="invalid_value") from None
        try:
            await engine.sleep(level, request.query_params.get("mode", "wait"))
        except (EngineShutdownError, EngineDeadError) as e:
            raise APIError(503, str(e), type="service_unavailable", code="service_unavailable") from None
        return Response(status_code=200)

    @router.post("/wake_up", response_class=Response, responses={200: {"description": "the tags named are awake"}})
    async def wake_up(request: Request) -> Response:
        _check_params(request, WAKE_UP_PARAMS)
        tags = request.query_params.getlist("tags") or None
        try:
            await engine.wake_up(tags)
        except EngineDeadError as e:
            raise APIError(503, str(e), type="service_unavailable", code="service_unavailable") from None
        return Response(status_code=200)

    @router.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": engine.is_sleeping})

    return router
