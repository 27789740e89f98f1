"""OpenAI's chat and completions surface, with vLLM's extra routes around it: /v1/models, /v1/chat/completions,
/v1/completions, their /render routes (what the engine would be given, nothing run: render.py), SageMaker's
/invocations, /tokenize, /detokenize, /tokenizer_info (only with --enable-tokenizer-info-endpoint, else 404 as vLLM)
and the run-time LoRA routes (only with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING). Each route is a method
of OpenAIServing, the one serving seam, or an adapter over it."""
from __future__ import annotations

import asyncio
import json
import os

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ValidationError

from kvflow.server.common.config import ServerConfig
from kvflow.server.common.errors import GENERATE_ERRORS, APIError, error_responses, streamed_or
from kvflow.server.openai.render import RenderedRequest, render_chat, render_completions
from kvflow.server.serving.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                            CompletionResponse, DetokenizeRequest, DetokenizeResponse, ModelList,
                                            TokenizeRequest, TokenizeResponse, TokenizerInfoResponse)
from kvflow.server.serving.serving import OpenAIServing

# /invocations reads its body itself (it is one of two requests): the document says which
INVOCATION_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"oneOf": [
    {"$ref": "#/components/schemas/ChatCompletionRequest"}, {"$ref": "#/components/schemas/CompletionRequest"}]}}}}}


def openai_router(serving: OpenAIServing, config: ServerConfig) -> APIRouter:
    engine = serving.engine
    router = APIRouter()

    @router.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **error_responses(401)})
    async def list_models():
        return serving.models()

    @router.post("/v1/chat/completions", response_model=None,
                 responses={**streamed_or(ChatCompletionResponse), **GENERATE_ERRORS})
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @router.post("/v1/completions", response_model=None,
                 responses={**streamed_or(CompletionResponse), **GENERATE_ERRORS})
    async def create_completion(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    # ---- vLLM's render routes: the engine's input for the same body, nothing run (render.py) ----------------------
    @router.post("/v1/chat/completions/render", response_model=None,
                 responses={200: {"model": RenderedRequest}, **error_responses(400, 401, 404, 413)})
    async def render_chat_completion(req: ChatCompletionRequest):
        return await render_chat(serving, req)

    @router.post("/v1/completions/render", response_model=None,
                 responses={200: {"model": list[RenderedRequest]}, **error_responses(400, 401, 404, 413)})
    async def render_completion(req: CompletionRequest):
        return await render_completions(serving, req)

    # ---- SageMaker's inference route, as vLLM serves it ----------------------------------------------------------
    @router.post("/invocations", response_model=None, openapi_extra=INVOCATION_BODY,
                 responses={**streamed_or(ChatCompletionResponse | CompletionResponse), **GENERATE_ERRORS})
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

    # ---- vLLM's extra routes -------------------------------------------------------------------------------------
    @router.post("/tokenize", response_model=None, responses={200: {"model": TokenizeResponse},
                                                              **error_responses(400, 401, 404, 413)})
    async def tokenize(req: TokenizeRequest):
        return await serving.tokenize(req)

    @router.post("/detokenize", response_model=None, responses={200: {"model": DetokenizeResponse},
                                                                **error_responses(400, 401, 404, 413)})
    async def detokenize(req: DetokenizeRequest):
        return await serving.detokenize(req)

    # LoRA adapters at run time (vLLM's routes): only with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING (or
    # KVFLOW_ALLOW_RUNTIME_LORA_UPDATING) true; otherwise 404, as vLLM answers
    if getattr(engine.config, "enable_lora", False) and runtime_lora_updating_allowed():
        @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=error_responses(400, 401))
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

        @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=error_responses(400, 401))
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
        @router.get("/tokenizer_info", response_model=None, responses={200: {"model": TokenizerInfoResponse},
                                                                       **error_responses(401)})
        async def tokenizer_info():
            return serving.tokenizer_info()

    return router


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
