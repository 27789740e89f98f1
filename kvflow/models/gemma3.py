"""Gemma 3 (text): the Llama decoder (llama.py: fused q/k/v and gate/up, Q/K norms, tensor-parallel split, GGUF
codes) with Gemma's differences, as transformers' Gemma3ForCausalLM computes them:

- the embedding scaled by sqrt(hidden_size) (a float32 scalar, rounded to the compute dtype);
- RMSNorm with the (1 + weight) convention: the checkpoint holds w, the norm multiplies by 1 + w, added once at load
  in float32 (the same float32 sum transformers makes each step); llama.cpp's GGUF holds 1 + w, which the loader
  turns back into w first, as transformers does;
- pre- and post-attention and pre- and post-feedforward norms around each block (a "sandwich");
- GeGLU with tanh GELU; attention scale query_pre_attn_scalar ** -0.5; head_dim 256; tied embeddings;
- local layers (`layer_types`: 5 sliding : 1 full on the released models) attend to their last `sliding_window`
  keys (PagedAttention's window) and rotate with their own RoPE base (`rope_local_base_freq`, 10k); global layers
  with `rope_theta` (1M) and its scaling (linear on the 4B+ models).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kvflow.distributed.parallel_state import TensorParallel
from kvflow.kernels.plan import KernelPlan
from kvflow.layers.attention_metadata import AttentionMetadata
from kvflow.layers.native_layers import NativeLayer
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.llama import MLP, Attention, LlamaForCausalLM, TensorParallelSizes
from kvflow.models.model_config import ModelConfig


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, sizes: TensorParallelSizes,
                 layer: int = 0, kernels: KernelPlan | None = None):
        super().__init__()
        self.sliding = cfg.is_sliding(layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, rotary, tp, sizes, layer, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MLP(cfg, tp, sizes)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, meta: AttentionMetadata,
                rope_local: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        attn = self.self_attn(rope_local if self.sliding else rope, self.input_layernorm(h), meta)
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), meta))

    def native_layer(self, model: Gemma3ForCausalLM) -> NativeLayer:
        """Llama's layer with a norm on each block's output before its residual add ("sandwich" norms), and the
        local rotary tables on sliding-window layers."""
        rotary = model.rotary_local if self.sliding else model.rotary
        return NativeLayer(self.self_attn.native(rotary), self.input_layernorm, self.pre_feedforward_layernorm,
                           attn_out_norm=self.post_attention_layernorm, mlp_out_norm=self.post_feedforward_layernorm,
                           **self.mlp.native())


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma3DecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel | None = None,
                 kernels: KernelPlan | None = None):
        super().__init__(cfg, max_positions, tp, kernels)
        # local layers: their own base, never scaled (transformers scales only the global layers' RoPE)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local_theta or 10000.0, None,
                                            cfg.rotary_dim)
        # sqrt(hidden) as transformers holds it: a float32 scalar, cast to the weights' dtype when applied
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.input_embeddings(input_ids)
        rope, rope_local = self.rotary.lookup(positions), self.rotary_local.lookup(positions)
        for layer in self.layers:
            h = layer(rope, h, meta, rope_local)
        return self.norm(h)

    def input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return h * torch.tensor(self.embed_scale, dtype=h.dtype)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint norms hold w; the model multiplies by 1 + w (summed here, in float32, once)."""
        super().load_weights((name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
                             for name, tensor in weights)
