"""/score, /v1/score, /rerank and /v1/rerank: a relevance score per text pair, as vLLM serves them (how a pair is
scored, by cross-encoding or an embedding model's cosine: `kvflow/scoring.py`).

Each prompt is one engine request carrying `PoolingParams` (prefill only, in the same continuous batch as everything
else); the adapter collects each stream's last delta, as /v1/embeddings does.
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter
from starlette.requests import Request

from kvflow.async_engine import RequestFailedError
from kvflow.pooling_params import PoolingParams
from kvflow.scoring import CROSS_ENCODING, cosine_scores, distinct_texts, pair_prompts, scoring_method
from kvflow.server.common.errors import GENERATE_ERRORS, APIError
from kvflow.server.score.protocol import (RERANK_OPENAPI, SCORE_OPENAPI, RerankDocument, RerankRequest, RerankResponse,
                                          RerankResult, RerankUsage, ScoreData, ScoreRequest, ScoreResponse,
                                          ScoreUsage)
from kvflow.server.serving.generation import merge, run_unless_disconnected
from kvflow.server.serving.protocol import random_id
from kvflow.server.serving.request_preparer import arrival_time
from kvflow.server.serving.serving import OpenAIServing


class ScoreServing:
    """The routes' methods, over the server's OpenAIServing (its model names, tokenizer, submit and errors)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def score(self, req: ScoreRequest, raw: Request | None = None) -> ScoreResponse:
        request_id = random_id("score")
        model, scores, tokens = await self._run(req, raw, request_id)
        return ScoreResponse(id=request_id, model=model,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def rerank(self, req: RerankRequest, raw: Request | None = None) -> RerankResponse:
        request_id = random_id("rerank")
        model, scores, tokens = await self._run(req, raw, request_id)
        _, docs = req.pairs()
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        top = order[:req.top_n] if req.top_n > 0 else order
        return RerankResponse(id=request_id, model=model, usage=RerankUsage(total_tokens=tokens), results=[
            RerankResult(index=i, relevance_score=scores[i],
                         document=RerankDocument(text=docs[i]) if req.return_documents else None) for i in top])

    async def _run(self, req: ScoreRequest | RerankRequest, raw: Request | None,
                   request_id: str) -> tuple[str, list[float], int]:
        """(the served model's name, one score per pair, the prompt tokens computed)."""
        preparer, engine = self.serving.preparer, self.serving.engine
        arrival = arrival_time(raw)
        model = preparer.check_model(req.model)
        method = scoring_method(engine.validator)
        firsts, seconds = req.pairs()
        preparer.check_prompt_chars(max(len(t) for t in firsts + seconds), "text_2" if req.ROUTE == "score"
                                    else "documents")
        params = req.sampling_params()
        activation = req.activation_on() and engine.model_config.score_sigmoid
        if method == CROSS_ENCODING:
            k = req.truncate_prompt_tokens
            prompts, pooling = await asyncio.to_thread(pair_prompts, engine.tokenizer, firsts, seconds,
                                                       engine.max_model_len if k == -1 else k, activation)
        else:
            texts = distinct_texts(firsts, seconds)
            prompts = await asyncio.to_thread(preparer.completion_prompt_ids, texts)
            pooling = PoolingParams(normalize=True)
        streams = preparer.submit(request_id, prompts, params, arrival, req.PARAM_NAMES, pooling=pooling,
                                  priority=preparer.priority(req), model=model)
        outputs = await self._collect(streams, raw)
        tokens = sum(s.num_prompt_tokens for s in streams)
        if method == CROSS_ENCODING:
            return model, [out[0] for out in outputs], tokens
        return model, cosine_scores(firsts, seconds, texts, outputs), tokens

    async def _collect(self, streams, raw: Request | None) -> list[list[float]]:
        outputs: list[list[float] | None] = [None] * len(streams)

        async def gather():
            async for index, delta in merge(streams):
                if delta.embedding is not None:
                    outputs[index] = delta.embedding

        try:
            await run_unless_disconnected(gather(), raw, streams)
        except RequestFailedError as e:
            raise self.serving.failure(e) from None
        if any(o is None for o in outputs):      # e.g. aborted by a shutdown past its grace period
            raise APIError(503, "the engine stopped before every text was scored", type="service_unavailable",
                           code="service_unavailable")
        return outputs


def score_router(scores: ScoreServing) -> APIRouter:
    """vLLM's paths: /score and /rerank, each also under /v1/."""
    router = APIRouter()

    async def create_score(req: ScoreRequest, raw: Request):
        return await scores.score(req, raw)

    async def create_rerank(req: RerankRequest, raw: Request):
        response = await scores.rerank(req, raw)
        return response.model_dump(exclude_none=True)     # without return_documents: no document key

    for prefix in ("", "/v1"):
        router.add_api_route(f"{prefix}/score", create_score, methods=["POST"], response_model=None,
                             responses={**SCORE_OPENAPI, **GENERATE_ERRORS},
                             operation_id=f"create_score{prefix.replace('/', '_')}")
        router.add_api_route(f"{prefix}/rerank", create_rerank, methods=["POST"], response_model=None,
                             responses={**RERANK_OPENAPI, **GENERATE_ERRORS},
                             operation_id=f"create_rerank{prefix.replace('/', '_')}")
    return router
