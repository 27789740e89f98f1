"""The pydantic pieces every surface's schema is built of: the model base (unknown fields ignored, as OpenAI's and
vLLM's servers do, so the field rule can see and log them), text that must be valid Unicode, and fields whose
limits are published in the OpenAPI document only (SamplingParams enforces them)."""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_unicode(text: str) -> str:
    # JSON's "\ud800" escape parses to a lone surrogate, which no tokenizer or UTF-8 encoder accepts
    if _LONE_SURROGATE.search(text):
        raise ValueError("text must be valid Unicode: it holds a lone UTF-16 surrogate")
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


def documented(default=None, **schema):
    """A field whose limits appear in the OpenAPI document only (SamplingParams enforces them)."""
    return Field(default, json_schema_extra=schema)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
