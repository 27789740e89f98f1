"""What every hybrid family (LFM2, Qwen3.5, Granite 4.0 H: recurrent layers between attention layers) is beyond the
Llama decoder it builds on: its attention layers own KV blocks, its recurrent layers state slots
(layers/recurrent_state.py), each found by type in layer order; one rank only (a state is not split over ranks);
no compiled decode graph (none takes state slots): the native step (runner/native_step.py) computes every family,
each layer describing itself for it (`native_layer`), and elsewhere they run layer by layer."""
from __future__ import annotations

from kvflow.distributed.parallel_state import TensorParallel
from kvflow.kernels.plan import KernelPlan
from kvflow.layers.attention import PagedAttention
from kvflow.layers.recurrent_state import RecurrentLayer
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.model_config import ModelConfig


class HybridForCausalLM(LlamaForCausalLM):
    compiled_decode = False
    recurrent_kind: str = ""          # the family's recurrent layers (ModelConfig.recurrent.kind)

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel | None = None,
                 kernels: KernelPlan | None = None):
        if tp is not None and tp.size > 1:
            raise ValueError(f"tensor_parallel_size={tp.size}: tensor parallelism is not supported for hybrid models "
                             f"({cfg.architecture}: its recurrent layers' states are not split over ranks); use "
                             "tensor_parallel_size=1")
        if cfg.recurrent is None or cfg.recurrent.kind != self.recurrent_kind:
            raise ValueError(f"{cfg.architecture}: expected {self.recurrent_kind} layers, the config gives "
                             f"{cfg.recurrent.kind if cfg.recurrent else 'none (every layer attention)'}")
        super().__init__(cfg, max_positions, tp, kernels)

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.modules() if isinstance(m, PagedAttention)]

    @property
    def state_layers(self) -> list[RecurrentLayer]:
        return [m for m in self.modules() if isinstance(m, RecurrentLayer)]
