"""LoRARequest: which LoRA adapter a request runs under, spelled as vLLM spells it (`vllm.lora.request.LoRARequest`).

`lora_int_id` is the adapter's identity inside the engine (slots, the CPU cache, prefix-cache keys): unique per
loaded adapter, > 0. The server gives every adapter it loads a fresh id, so an adapter unloaded and loaded again
under the same name never shares KV or a slot with its former self.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path must not be empty")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
