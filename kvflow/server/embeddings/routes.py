"""/v1/embeddings: OpenAI's Embeddings API (with vLLM's extras) over the served model's pooled final hidden states.

An adapter over the one submit path: each input is one engine request carrying `PoolingParams` (prefill only, in the
same continuous batch as generation; the engine's `--pooling` says last token or mean, `pooling_params.py` how the
vector is finished); each request's stream ends with one delta carrying its vector, collected here.

The field rule holds: every field of vLLM's EmbeddingCompletionRequest (and OpenAI's) is implemented here or refused
with a 400 naming it (`request_fields.py`, REFUSED["embeddings"]); a field neither defines is ignored, logged once.
"""
from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request

from kvflow.async_engine import RequestFailedError
from kvflow.server.common.errors import GENERATE_ERRORS, APIError
from kvflow.server.embeddings.protocol import (BYTE_ORDERS, EMBEDDINGS_OPENAPI, EmbeddingData, EmbeddingRequest,
                                               EmbeddingResponse, EmbeddingUsage)
from kvflow.server.serving.protocol import random_id
from kvflow.server.serving.generation import merge, run_unless_disconnected
from kvflow.server.serving.request_preparer import arrival_time
from kvflow.server.serving.serving import OpenAIServing


class EmbeddingsServing:
    """The route's method, over the server's OpenAIServing (its model names, tokenization, submit and errors)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: EmbeddingRequest, raw: Request | None = None, *, priority: int = 0
                     ) -> EmbeddingResponse:
        """`priority`: the base the request's own priority adds to (the Batch API's; 0 for interactive)."""
        serving, preparer = self.serving, self.serving.preparer
        arrival = arrival_time(raw)
        model = preparer.check_model(req.model)
        inputs = req.inputs()
        pooling = req.pooling_params(serving.engine.model_config.normalize)
        params = req.sampling_params()
        preparer.check_prompt_chars(max((len(p) for p in inputs if isinstance(p, str)), default=0), "input")
        prompt_ids = await asyncio.to_thread(preparer.completion_prompt_ids, inputs, req.add_special_tokens)
        request_id = f"embd-{req.request_id}" if req.request_id else random_id("embd")
        streams = preparer.submit(request_id, prompt_ids, params, arrival, req.PARAM_NAMES, pooling=pooling,
                                  priority=preparer.priority(req, priority), model=model)
        vectors: list[list[float] | None] = [None] * len(streams)

        async def gather():
            async for index, delta in merge(streams):
                if delta.embedding is not None:
                    vectors[index] = delta.embedding

        try:
            await run_unless_disconnected(gather(), raw, streams)
        except RequestFailedError as e:
            raise serving.failure(e) from None
        if any(v is None for v in vectors):      # e.g. aborted by a shutdown past its grace period
            raise APIError(503, "the engine stopped before every input was embedded", type="service_unavailable",
                           code="service_unavailable")
        prompt_tokens = sum(s.num_prompt_tokens for s in streams)
        return EmbeddingResponse(
            id=request_id, model=model,
            data=[EmbeddingData(index=i, embedding=encode(v, req.encoding_format, req.endianness))
                  for i, v in enumerate(vectors)],
            usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))


def encode(vector: list[float], encoding_format: str, endianness: str = "native") -> list[float] | str:
    """A vector as the response carries it: floats, or base64 of its float32 bytes in the given byte order."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype=BYTE_ORDERS[endianness]).tobytes()).decode("ascii")


def embeddings_router(embeddings: EmbeddingsServing) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings", response_model=None, responses={**EMBEDDINGS_OPENAPI, **GENERATE_ERRORS})
    async def create_embedding(req: EmbeddingRequest, raw: Request):
        return await embeddings.create(req, raw)

    return router
