"""/score, /v1/score, /rerank and /v1/rerank: a relevance score per text pair, as vLLM serves them.

How a pair is scored depends on the model, as in vLLM:
- a score model (task "score": a cross-encoder such as BertForSequenceClassification, or a decoder reranker made one
  by --hf-overrides classifier_from_token) reads the pair as one prompt, joined as its tokenizer joins a pair
  (BERT: [CLS] first [SEP] second [SEP], token_type_ids 1 on the second text); its head's logit is the score, through
  a sigmoid unless `use_activation` is off (`PoolingParams.output`);
- an embedding model (task "embed" alone: BertModel) embeds every text and scores a pair by the cosine similarity of
  the two vectors;
- anything else (a generative decoder) is a 400 saying why.

Each prompt is one engine request carrying `PoolingParams` (prefill only, in the same continuous batch as everything
else); the adapter collects each stream's last delta, as /v1/embeddings does.
"""
from __future__ import annotations

import asyncio

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request

from kvflow.async_engine import RequestFailedError
from kvflow.errors import InvalidRequestError
from kvflow.pooling_params import PoolingParams
from kvflow.server.common.errors import GENERATE_ERRORS, APIError
from kvflow.server.score.protocol import (RERANK_OPENAPI, SCORE_OPENAPI, RerankDocument, RerankRequest, RerankResponse,
                                          RerankResult, RerankUsage, ScoreData, ScoreRequest, ScoreResponse,
                                          ScoreUsage, _ScoringRequest)
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
        preparer = self.serving.preparer
        arrival = arrival_time(raw)
        model = preparer.check_model(req.model)
        tasks = self.serving.engine.model_config.tasks
        firsts, seconds = req.pairs()
        preparer.check_prompt_chars(max(len(t) for t in firsts + seconds), "text_2" if req.ROUTE == "score"
                                    else "documents")
        if "score" in tasks:
            prompts, pooling = await asyncio.to_thread(self._pair_prompts, req, firsts, seconds)
        elif tasks == ("embed",):
            texts = list(dict.fromkeys(firsts + seconds))       # each distinct text embedded once
            prompts = await asyncio.to_thread(preparer.completion_prompt_ids, texts)
            pooling = PoolingParams(normalize=True)
        else:
            try:
                self.serving.engine.validator.check_task("score")
            except InvalidRequestError as e:
                raise APIError.bad_request(e, {}) from None
        params = req.sampling_params()
        streams = preparer.submit(request_id, prompts, params, arrival, req.PARAM_NAMES, pooling=pooling,
                                  priority=preparer.priority(req), model=model)
        outputs = await self._collect(streams, raw)
        tokens = sum(s.num_prompt_tokens for s in streams)
        if "score" in tasks:
            return model, [out[0] for out in outputs], tokens
        vectors = {text: np.asarray(v) for text, v in zip(texts, outputs)}
        return model, [cosine(vectors[a], vectors[b]) for a, b in zip(firsts, seconds)], tokens

    def _pair_prompts(self, req: _ScoringRequest, firsts: list[str],
                      seconds: list[str]) -> tuple[list[list[int]], list[PoolingParams]]:
        """Each pair as the tokenizer joins it (truncated to truncate_prompt_tokens, longest text first, as vLLM
        asks the tokenizer), with its own token types."""
        k = req.truncate_prompt_tokens
        max_length = self.serving.engine.max_model_len if k == -1 else k
        activation = req.activation_on() and self.serving.engine.model_config.score_sigmoid
        prompts, pooling = [], []
        for first, second in zip(firsts, seconds):
            ids, type_start = self.serving.engine.tokenizer.encode_pair(first, second, max_length)
            prompts.append(ids)
            pooling.append(PoolingParams(task="score", use_activation=activation, token_type_start=type_start))
        return prompts, pooling

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


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity (vLLM's embedding score: torch's cosine_similarity, eps 1e-8 on each norm)."""
    return float(a @ b / (max(float(np.linalg.norm(a)), 1e-8) * max(float(np.linalg.norm(b)), 1e-8)))


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
