"""/v1/embeddings' request and response: vLLM's EmbeddingCompletionRequest field by field (implemented here or
refused in `serving/request_fields.py`, REFUSED["embeddings"]) and OpenAI's response."""
from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, Union

from pydantic import Field, model_validator

from kvflow.errors import InvalidRequestError
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams
from kvflow.server.common.errors import APIError
from kvflow.server.common.schema import OpenAIModel, Text, documented
from kvflow.server.serving.protocol import PRIORITY_FIELD, apply_field_rule, prompt_list

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
    truncation_side: Literal["left", "right"] | None = None     # "right": keep each input's first k tokens
    add_special_tokens: bool = True      # the tokenizer's BOS etc. when encoding a text input
    normalize: bool | None = None        # L2-normalise the vector; None: the model's (yes, unless its
                                         # sentence-transformers folder has no Normalize module)
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

    def pooling_params(self, normalize_default: bool = True) -> PoolingParams:
        """`normalize_default`: the model's (a sentence-transformers folder without a Normalize module: off)."""
        if None not in (self.normalize, self.use_activation) and self.normalize != self.use_activation:
            raise APIError(400, "normalize and use_activation are one switch here, and they disagree: give one",
                           param="use_activation")
        normalize = self.normalize if self.normalize is not None else self.use_activation
        return PoolingParams(normalize=normalize_default if normalize is None else normalize)

    def sampling_params(self) -> SamplingParams:
        """What the validator reads of an embedding request: its prompt truncation (nothing is sampled)."""
        try:
            return SamplingParams(truncate_prompt_tokens=self.truncate_prompt_tokens,
                                  truncation_side=self.truncation_side or "left")
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
