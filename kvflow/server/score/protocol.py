"""/score and /rerank's requests and responses: vLLM's ScoreRequest and RerankRequest field by field (implemented
here or refused in `serving/request_fields.py`, REFUSED["score"] / ["rerank"]) and vLLM's responses (Jina's and
Cohere's rerank shape)."""
from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, Union

from pydantic import Field, model_validator

from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import SamplingParams
from kvflow.scoring import pairs
from kvflow.server.common.errors import APIError
from kvflow.server.common.schema import OpenAIModel, Text, documented
from kvflow.server.serving.protocol import PRIORITY_FIELD, apply_field_rule

MAX_TEXTS = 2048                      # one request's texts on either side at most, as /v1/embeddings' inputs


class _ScoringRequest(OpenAIModel):
    """What /score and /rerank share: the model, truncation, priority and the activation switch."""
    model: Text | None = None
    truncate_prompt_tokens: int | None = documented(minimum=-1, description="truncate each pair (or each text an "
                                                    "embedding model embeds) to this many tokens (-1: max_model_len)")
    priority: int = PRIORITY_FIELD
    # vLLM's one switch under three names over its versions: the score's activation (sigmoid for a one-label
    # cross-encoder); None: on
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    ROUTE: ClassVar[str]
    PARAM_NAMES: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_implemented(cls, data: Any) -> Any:
        return apply_field_rule(cls.ROUTE, data, cls.model_fields) if isinstance(data, dict) else data

    def activation_on(self) -> bool:
        given = {name: v for name in ("use_activation", "activation", "softmax")
                 if (v := getattr(self, name)) is not None}
        if len(set(given.values())) > 1:
            raise APIError(400, f"{', '.join(given)} are one switch (the score's activation), and they disagree: "
                           "give one", param="use_activation")
        return next(iter(given.values()), True)

    def sampling_params(self) -> SamplingParams:
        """What the validator reads of a scoring request: the truncation of an embedded text (nothing is sampled)."""
        try:
            return SamplingParams(truncate_prompt_tokens=self.truncate_prompt_tokens)
        except InvalidRequestError as e:
            raise APIError.bad_request(e, self.PARAM_NAMES) from None

    @staticmethod
    def texts(value: str | list[str], param: str) -> list[str]:
        texts = [value] if isinstance(value, str) else list(value)
        if len(texts) > MAX_TEXTS:
            raise APIError(400, f"{param} holds {len(texts)} texts, more than {MAX_TEXTS}", param=param,
                           code="invalid_value")
        return texts


class ScoreRequest(_ScoringRequest):
    """vLLM's ScoreRequest: text_1 against text_2, 1:1, 1:N (text_1 one text) or N:N (pairwise, in order)."""
    text_1: Union[Text, list[Text]]
    text_2: Union[Text, list[Text]]

    ROUTE: ClassVar[str] = "score"

    def pairs(self) -> tuple[list[str], list[str]]:
        """(firsts, seconds), one pair per score: text_1 repeated when it is one text."""
        return pairs(self.texts(self.text_1, "text_1"), self.texts(self.text_2, "text_2"))


class RerankDocumentIn(OpenAIModel):
    text: Text


class RerankRequest(_ScoringRequest):
    """vLLM's RerankRequest (Jina's and Cohere's shape): the query against each document."""
    query: Text
    documents: list[Union[Text, RerankDocumentIn]]
    top_n: int = documented(0, minimum=0, description="the best this many results (0: every document)")
    return_documents: bool = True        # each result carries its document's text

    ROUTE: ClassVar[str] = "rerank"

    def pairs(self) -> tuple[list[str], list[str]]:
        docs = [d if isinstance(d, str) else d.text for d in self.documents]
        return pairs([self.query], self.texts(docs, "documents"), ("query", "documents"))


class ScoreData(OpenAIModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(OpenAIModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocument(OpenAIModel):
    text: str


class RerankResult(OpenAIModel):
    index: int
    document: RerankDocument | None = None      # without return_documents: left out
    relevance_score: float


class RerankUsage(OpenAIModel):
    total_tokens: int


class RerankResponse(OpenAIModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


SCORE_OPENAPI = {200: {"model": ScoreResponse, "description": "one score per pair, in pair order"}}
RERANK_OPENAPI = {200: {"model": RerankResponse, "description": "the documents by relevance, best first"}}
