"""Scoring text pairs, vLLM's score task, for LLM.score and the server's /score and /rerank alike.

How a pair is scored depends on the model, as in vLLM:
- a score model (task "score": a cross-encoder such as BertForSequenceClassification, or a decoder reranker made one
  by --hf-overrides classifier_from_token) reads the pair as one prompt, joined as its tokenizer joins a pair
  (BERT: [CLS] first [SEP] second [SEP], token_type_ids 1 on the second text); its head's logit is the score, through
  a sigmoid unless `use_activation` is off (`PoolingParams.output`);
- an embedding model (task "embed" alone: BertModel) embeds every distinct text once and scores a pair by the cosine
  similarity of the two vectors;
- anything else (a generative decoder) is the validator's InvalidRequestError saying why.
"""
from __future__ import annotations

import numpy as np

from kvflow.core.request_validator import RequestValidator
from kvflow.errors import InvalidRequestError
from kvflow.pooling_params import PoolingParams

CROSS_ENCODING, EMBEDDING_COSINE = "cross-encoding", "embedding cosine"


def scoring_method(validator: RequestValidator) -> str:
    """CROSS_ENCODING or EMBEDDING_COSINE for the served model; InvalidRequestError (param "model") for a model that
    scores neither way."""
    if "score" in validator.tasks:
        return CROSS_ENCODING
    if validator.tasks == ("embed",):
        return EMBEDDING_COSINE
    validator.check_task("score")
    raise AssertionError("check_task raises for a model without the score task")


def pairs(text_1: list[str], text_2: list[str], names: tuple[str, str] = ("text_1", "text_2")
          ) -> tuple[list[str], list[str]]:
    """vLLM's shapes: 1:1, 1:N (the one first text against each second) or N:N (pairwise, in order); `names`: the
    fields an error names."""
    if not text_1:
        raise InvalidRequestError(f"{names[0]}: give at least one text", param=names[0], code="invalid_value")
    if not text_2:
        raise InvalidRequestError(f"{names[1]}: give at least one text", param=names[1], code="invalid_value")
    if len(text_1) == 1:
        return text_1 * len(text_2), text_2
    if len(text_1) != len(text_2):
        raise InvalidRequestError(f"{names[0]} has {len(text_1)} texts and {names[1]} {len(text_2)}: the lengths must "
                                  "be 1:1, 1:N or N:N", param=names[1], code="invalid_value")
    return text_1, text_2


def pair_prompts(tokenizer, firsts: list[str], seconds: list[str], max_length: int | None,
                 use_activation: bool) -> tuple[list[list[int]], list[PoolingParams]]:
    """Each pair as the tokenizer joins it (truncated to `max_length`, the longer text first, as vLLM asks the
    tokenizer), with its own token types: a score model's prompts and pooling parameters."""
    prompts, pooling = [], []
    for first, second in zip(firsts, seconds):
        ids, type_start = tokenizer.encode_pair(first, second, max_length)
        prompts.append(ids)
        pooling.append(PoolingParams(task="score", use_activation=use_activation, token_type_start=type_start))
    return prompts, pooling


def distinct_texts(firsts: list[str], seconds: list[str]) -> list[str]:
    """The texts an embedding model embeds to score these pairs: each once, in first appearance order."""
    return list(dict.fromkeys(firsts + seconds))


def cosine_scores(firsts: list[str], seconds: list[str], texts: list[str], vectors: list[list[float]]) -> list[float]:
    """Each pair's cosine similarity (vLLM's embedding score: torch's cosine_similarity, eps 1e-8 on each norm),
    from the vectors of `texts` (distinct_texts)."""
    by_text = {text: np.asarray(v, dtype=np.float64) for text, v in zip(texts, vectors)}

    def cosine(a: np.ndarray, b: np.ndarray) -> float:
        return float(a @ b / (max(float(np.linalg.norm(a)), 1e-8) * max(float(np.linalg.norm(b)), 1e-8)))

    return [cosine(by_text[a], by_text[b]) for a, b in zip(firsts, seconds)]
