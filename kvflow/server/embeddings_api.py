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
import time
from typing import Any, ClassVar, Literal, Union

import numpy as np
from pydantic import Field, model_validator
from starlette.requests import Request

from kvflow.async_engine import RequestFailedError
from kvflow.errors import InvalidRequestError
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams
from kvflow.server.protocol import (PRIORITY_FIELD, APIError, OpenAIModel, Text, apply_field_rule, documented, prompt_list,
                                    random_id)
from kvflow.server.serving import OpenAIServing, arrival_time, merge, run_unless_disconnected

MAX_INPUTS = 2048                       # one request's inputs at most, as OpenAI allows
# the bytes of a base64 vector: float32 (OpenAI's, and what its client decodes), in this byte order
BYTE_ORDERS = {"native": "=f4", "little": "<f4", "big": ">f4"}


class EmbeddingRequest(OpenAIModel):
    """vLLM's EmbeddingCompletionRequest, less what REFUSED["embeddings"] refuses."""
    model: Text | None = None
    # one text, several texts, one prompt's token ids, or several prompts' token ids: one vector each
    input: Union[Text, list[Text], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"      # base64: float32 bytes (little-endian, as OpenAI)
    user: Text | None = None             # an end-user tag (OpenAI's, for its abuse monitoring): no effect here
    # vLLM's extras
    truncate_prompt_tokens: int | None = documented(minimum=-1, description="keep each input's last k tokens "
                                                    "(-1: the last max_model_len)")
    add_special_tokens: bool = True      # the tokenizer's BOS etc. when encoding a text input
    normalize: bool | None = None        # L2-normalise the vector; None: yes, as vLLM's embedding runners
    use_activation: bool | None = None   # vLLM's later name for normalize (the embedding pooler's activation)
    endianness: Literal["native", "little", "big"] = "native"   # of base64's bytes (native: little on x86 and ARM)
    request_id: Text | None = documented(description="the response's id is built from it (embd-ID)")
    priority: int = PRIORITY_FIELD

    ROUTE: ClassVar[str] = "embeddings"
    PARAM_NAMES: ClassVar[dict[str, str]] = {"prompt": "input"}     # the validator's names -> this request's

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_implemented(cls, data: Any) -> Any:
        return apply_field_rule(cls.ROUTE, data, cls.model_fields) if isinstance(data, dict) else data

    def inputs(self) -> list[str | list[int]]:
        inputs = prompt_list(self.input, "input")
        if len(inputs) > MAX_INPUTS:
            raise APIError(400, f"input holds {len(inputs)} inputs, more than {MAX_INPUTS}", param="input",
                           code="invalid_value")
        return inputs

    def pooling_params(self) -> PoolingParams:
        if None not in (self.normalize, self.use_activation) and self.normalize != self.use_activation:
            raise APIError(400, "normalize and use_activation are one switch here, and they disagree: give one",
                           param="use_activation")
        normalize = self.normalize if self.normalize is not None else self.use_activation
        return PoolingParams(normalize=normalize is not False)

    def sampling_params(self) -> SamplingParams:
        """What the validator reads of an embedding request: its prompt truncation (nothing is sampled)."""
        try:
            return SamplingParams(truncate_prompt_tokens=self.truncate_prompt_tokens)
        except InvalidRequestError as e:
            raise APIError.bad_request(e, self.PARAM_NAMES) from None


class EmbeddingData(OpenAIModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], str]       # str: base64 (encoding_format)


class EmbeddingUsage(OpenAIModel):
    prompt_tokens: int
    total_tokens: int                        # = prompt_tokens: nothing is generated


class EmbeddingResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


EMBEDDINGS_OPENAPI = {200: {"model": EmbeddingResponse, "description": "one vector per input, in input order"}}


class EmbeddingsServing:
    """The route's method, over the server's OpenAIServing (its model names, tokenization, submit and errors)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: EmbeddingRequest, raw: Request | None = None, *, priority: int = 0
                     ) -> EmbeddingResponse:
        """`priority`: the base the request's own priority adds to (the Batch API's; 0 for interactive)."""
        serving = self.serving
        arrival = arrival_time(raw)
        model = serving.check_model(req.model)
        inputs = req.inputs()
        pooling, params = req.pooling_params(), req.sampling_params()
        serving.check_prompt_chars(max((len(p) for p in inputs if isinstance(p, str)), default=0), "input")
        prompt_ids = await asyncio.to_thread(serving.completion_prompt_ids, inputs, req.add_special_tokens)
        request_id = f"embd-{req.request_id}" if req.request_id else random_id("embd")
        streams = serving.submit(request_id, prompt_ids, params, arrival, req.PARAM_NAMES, pooling=pooling,
                                 priority=serving.priority(req, priority), model=model)
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
