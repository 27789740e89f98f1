"""Mixture-of-experts decoders: Qwen3-MoE, OLMoE, GraniteMoE and Mixtral, as transformers computes them.

llama.py's decoder (its attention: Q/K norms per head for Qwen3-MoE, over the whole projection for OLMoE; llama.cpp's
permuted Q/K rows in Mixtral's and GraniteMoE's GGUFs; Mixtral's sliding window) with `layers/moe.py`'s router and
experts in place of the dense MLP (Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step` keep a dense one), and
Granite's four scalings: the embedding times `embedding_multiplier`, each block's output times `residual_multiplier`
before its residual add, `attention_multiplier` as the attention scale, the logits divided by `logits_scaling`.

Checkpoint names reach `load_weights` in one form, `layers.N.mlp.gate.weight` (the router) and
`layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, whatever the checkpoint called them (`loader.canonical_experts`:
Mixtral's `block_sparse_moe.experts.E.w1/w3/w2`, GraniteMoE's stacked `input_linear` / `output_linear`, a GGUF's
stacked `ffn_*_exps`); llama.py fuses each expert's gate and up as it fuses the dense MLP's.

Where kvflow's kernels hold every expert (layers/moe.py: the routing and the grouping by expert are then native
calls), the runner's native decoder step computes the whole model (runner/native_step.py), or, where that does not
build (OLMoE's QKV clipping), decode steps compile; neither otherwise (grouping in Python depends on the step's
data, which a whole-graph compile cannot trace). Not here: tensor parallelism (experts are not split over ranks) and LoRA on MoE models: both refused.
"""
from __future__ import annotations

import torch
from torch import nn

from kvflow.distributed.parallel_state import TensorParallel
from kvflow.kernels.plan import KernelPlan
from kvflow.layers.attention_metadata import AttentionMetadata
from kvflow.layers.moe import SparseMoE
from kvflow.layers.native_layers import NativeLayer, NotNative
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.llama import _ACTIVATIONS, MLP, Attention, LlamaForCausalLM, TensorParallelSizes
from kvflow.models.model_config import ModelConfig


class MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, sizes: TensorParallelSizes,
                 layer: int = 0, kernels: KernelPlan | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, rotary, tp, sizes, layer, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        if cfg.is_moe_layer(layer):
            if cfg.hidden_act not in _ACTIVATIONS:
                raise ValueError(f"hidden activation {cfg.hidden_act!r} is not supported ({', '.join(_ACTIVATIONS)})")
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.arch.moe_router, cfg.norm_topk_prob, _ACTIVATIONS[cfg.hidden_act])
        else:
            self.mlp = MLP(cfg, tp, sizes)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(rope, self.input_layernorm(h), meta)
        h = h + (attn if self.residual_multiplier is None else attn * self.residual_multiplier)
        out = self.mlp(self.post_attention_layernorm(h), meta)
        return h + (out if self.residual_multiplier is None else out * self.residual_multiplier)

    def native_layer(self, model: MoeForCausalLM) -> NativeLayer:
        """Llama's layer with the experts (or a dense MLP) and Granite's residual scale."""
        if self.self_attn.rotary is not model.rotary:
            raise NotNative("a layer with its own rotary tables")
        mlp = dict(moe=self.mlp) if isinstance(self.mlp, SparseMoE) else self.mlp.native()
        scale = 1.0 if self.residual_multiplier is None else self.residual_multiplier
        return NativeLayer(self.self_attn.native(model.rotary), self.input_layernorm, self.post_attention_layernorm,
                           residual_scale=scale, **mlp)


class MoeForCausalLM(LlamaForCausalLM):
    decoder_layer = MoeDecoderLayer

    @property
    def compiled_decode(self) -> bool:
        """Whether the runner may compile decode graphs of this model (runner/model_runner.py): only where every
        expert layer runs as one native call (see the module docstring)."""
        return all(m.native for m in self.modules() if isinstance(m, SparseMoE))

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel | None = None,
                 kernels: KernelPlan | None = None):
        if tp is not None and tp.size > 1:
            raise ValueError(f"tensor_parallel_size={tp.size}: tensor parallelism is not supported for "
                             f"mixture-of-experts models ({cfg.architecture}); use tensor_parallel_size=1")
        super().__init__(cfg, max_positions, tp, kernels)

    def enable_lora(self, *args, **kwargs) -> None:
        raise ValueError(f"LoRA is not supported for mixture-of-experts models ({self.config.architecture})")

    def _shard_sizes(self, name: str) -> list[int]:
        if ".experts." in name and "gate_up_proj" in name:
            return [self.config.moe_intermediate_size] * 2
        return super()._shard_sizes(name)
