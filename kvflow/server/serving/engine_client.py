"""What the server asks of an engine: `EngineClient`, as vLLM's (vllm/engine/protocol.py) names it.

`kvflow.async_engine.AsyncEngine` is the one engine that implements it (tests/test_server.py checks that it does);
the tests of the seam alone drive it with a small double (tests/test_server_handlers.py's FakeEngine). Every member
is always present on an engine: the seam reads them directly, never with a fallback.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from kvflow.async_engine import AddRequest, BeamSearchStream, RequestStream
from kvflow.beam_search import BeamSearchParams
from kvflow.config import EngineConfig
from kvflow.core.request_validator import RequestValidator
from kvflow.lora_request import LoRARequest
from kvflow.models.model_config import ModelConfig
from kvflow.tokenizer import Tokenizer


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Tokenizer
    config: EngineConfig                  # scheduling_policy (a request's own priority), enable_lora
    model_path: Path                      # /v1/models' root
    served_model_name: str                # the default of --served-model-name
    max_model_len: int
    vocab_size: int
    validator: RequestValidator           # the /render routes' check of a prompt, the one `submit` makes
    model_config: ModelConfig             # the model's tasks and pooling defaults (normalize, a score's activation)
    loras: dict[str, LoRARequest]         # the LoRA adapters served now, by name (empty without --enable-lora)

    @property
    def is_accepting(self) -> bool:
        """False once shutdown began or the engine died."""

    def submit(self, request: AddRequest) -> RequestStream:
        """One request (its n choices) to the engine; raises InvalidRequestError, EngineOverloadedError,
        EngineShutdownError or EngineDeadError before anything runs."""

    def beam_search(self, request: AddRequest, params: BeamSearchParams) -> BeamSearchStream:
        """A beam search of `request`'s prompt (its SamplingParams give only the prompt's truncation), whose stream
        stands where `submit`'s would; raises as `submit` does."""

    async def shutdown(self, grace_period: float = 30.0) -> None:
        """Stop accepting, let requests in flight finish within `grace_period`, fail the rest, stop."""

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Serve the PEFT adapter at `path` as model `name` (a ValueError naming the problem otherwise)."""

    def remove_lora(self, name: str) -> LoRARequest:
        """Stop serving adapter `name` (KeyError when unknown)."""
