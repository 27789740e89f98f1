"""kvflow: a fast, compact LLM inference server with continuous batching over a paged KV cache."""
from kvflow.config import EngineConfig
from kvflow.llm import LLM
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "__version__"]
