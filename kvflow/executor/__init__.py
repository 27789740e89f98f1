"""Executors: what sits between `EngineCore.step` and the model runner(s). The core hands an executor a
`ModelStep` and gets `SampledTokens` back; whether one process runs the step or several ranks share it is
the executor's business.

- `LocalExecutor`: the runner in this process;
- `tensor_parallel.TensorParallelExecutor`: rank 0 of a tensor-parallel group; starts the other ranks
  (`worker`), sends each step, notices deaths.
"""
from __future__ import annotations

from pathlib import Path

from kvflow.config import EngineConfig
from kvflow.models.model_config import ModelConfig
from kvflow.runner.model_runner import ModelRunner
from kvflow.runner.step import ModelStep, SampledTokens


class LocalExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path, max_model_len: int):
        self.runner = ModelRunner(config, model_config, model_path, max_model_len)

    def execute(self, step: ModelStep) -> SampledTokens:
        return self.runner.execute(step)

    def set_lora_slot(self, slot: int, weights) -> None:
        """Between steps: an adapter's weights into a LoRA slot (None clears it)."""
        self.runner.set_lora_slot(slot, weights)

    def check_health(self) -> None:
        """Nothing can die apart from this process."""

    def shutdown(self) -> None:
        self.runner.shutdown()


def create_executor(config: EngineConfig, model_config: ModelConfig, model_path: Path, max_model_len: int):
    if config.tensor_parallel_size > 1:
        from kvflow.executor.tensor_parallel import TensorParallelExecutor
        from kvflow.models.llama import check_tensor_parallel
        check_tensor_parallel(model_config, config.tensor_parallel_size)   # before any process starts
        return TensorParallelExecutor(config, model_config, model_path, max_model_len)
    return LocalExecutor(config, model_config, model_path, max_model_len)
