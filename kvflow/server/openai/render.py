"""vLLM's render routes: POST /v1/chat/completions/render and /v1/completions/render take the body of
/v1/chat/completions or /v1/completions and answer with what the engine would be given, without running the model:
vLLM's GenerateRequest (vllm/entrypoints/serve/disagg/protocol.py; the routes in entrypoints/serve/render/), one for
a chat, a list of them (one per prompt) for a completion. A router computes prefix-cache hits from `token_ids`, or
hands the request to a generate-only server.

The prompt comes from the generate routes' own path (`RequestPreparer.prepare_chat` / `prepare_completions`, then
the engine's validator, `RequestPreparer.admit`): the same chat template, tools, encoding, truncation and checks, so
`token_ids` are the very ids the route runs, and a request the route would refuse gets the same 400 (or 404),
naming the same field. The field rule is the route's own: the body is its request model.

`sampling_params` is written as vLLM writes its SamplingParams there: the fields that differ from their defaults
(vLLM's names; omitted, they mean the default), none of the engine's own (the tokenized bad words, the compiled
grammar: vLLM's underscored fields), with max_tokens resolved as the engine resolves it, always present, and the
truncation left out because `token_ids` already have it applied (vLLM truncates while rendering too). The output
constraint is vLLM's `structured_outputs` (`json`, `json_object`, `regex`, `choice`, `grammar` or `structural_tag`):
what the request's own field asked for, or a forced tool call's grammar."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import Field

from kvflow.sampling_params import SamplingParams
from kvflow.server.common.errors import APIError
from kvflow.server.common.schema import OpenAIModel
from kvflow.server.serving.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from kvflow.server.serving.request_preparer import PreparedRequest
from kvflow.server.serving.serving import OpenAIServing

# SamplingParams' fields the render does not show: worked out by the server for the engine (vLLM leaves its own out
# the same way), or already applied to token_ids
NOT_SHOWN = frozenset({"bad_words_token_ids", "structured", "structured_outputs", "truncate_prompt_tokens",
                       "truncation_side", "max_tokens"})
# a compiled constraint's kind -> vLLM's StructuredOutputsParams field
STRUCTURED_OUTPUTS_FIELD = {"json_schema": "json", "json_object": "json_object", "regex": "regex",
                            "choice": "choice", "grammar": "grammar", "structural_tag": "structural_tag"}


class RenderedRequest(OpenAIModel):
    """vLLM's GenerateRequest: a request as token ids and sampling parameters, with its routing fields."""
    request_id: str = Field(description="the engine's id of this prompt (chatcmpl-ID, cmpl-ID, cmpl-ID-pK)")
    token_ids: list[int] = Field(description="the prompt's token ids, exactly as the model would run them")
    features: dict[str, Any] | None = Field(None, description="multimodal features: always null (text only)")
    sampling_params: dict[str, Any] = Field(description="vLLM's SamplingParams: the fields not at their default")
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None


async def render_chat(serving: OpenAIServing, req: ChatCompletionRequest) -> RenderedRequest:
    prepared = await serving.preparer.prepare_chat(req)
    return rendered(serving, req, prepared, 0)


async def render_completions(serving: OpenAIServing, req: CompletionRequest) -> list[RenderedRequest]:
    prepared = await serving.preparer.prepare_completions(req)
    return [rendered(serving, req, prepared, k) for k in range(len(prepared.prompt_ids))]


def rendered(serving: OpenAIServing, req: ChatCompletionRequest | CompletionRequest, prepared: PreparedRequest,
             index: int) -> RenderedRequest:
    """Prompt `index` of a prepared request, admitted as the engine would admit it."""
    if prepared.beam is not None:       # a search of many one-token requests: no one GenerateRequest to show
        raise APIError(400, "the render routes do not render beam search requests", param="use_beam_search",
                       code="invalid_value")
    token_ids, max_tokens = serving.preparer.admit(prepared.prompt_ids[index], prepared.params, req.PARAM_NAMES)
    return RenderedRequest(request_id=prepared.engine_request_id(index), token_ids=token_ids,
                           sampling_params=sampling_params_json(prepared.params, max_tokens), model=req.model,
                           stream=bool(req.stream), stream_options=req.stream_options if req.stream else None,
                           priority=req.priority)


def sampling_params_json(params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """`params` as vLLM serializes its SamplingParams: the fields not at their defaults, max_tokens resolved."""
    defaults = SamplingParams()
    shown = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
             if f.name not in NOT_SHOWN and getattr(params, f.name) != getattr(defaults, f.name)}
    shown["max_tokens"] = max_tokens
    if params.structured is not None:
        shown["structured_outputs"] = structured_outputs_json(params.structured.spec)
    return shown


def structured_outputs_json(spec) -> dict[str, Any]:
    """A compiled constraint's StructuredSpec as vLLM's StructuredOutputsParams (the JSON payloads parsed back)."""
    name = STRUCTURED_OUTPUTS_FIELD[spec.kind]
    if spec.kind == "json_object":
        return {name: True}
    value = json.loads(spec.payload) if spec.kind in ("json_schema", "choice") else spec.payload
    return {name: value}
