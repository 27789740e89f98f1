"""What kvflow's native decoder step computes, as each model family describes its own layers: plain data over the
family's modules (their weights stay where they are), so the runner's native step (runner/native_step.py) reads a
description instead of knowing each family by type. A family whose layers are not one of these shapes says why
with `NotNative`, and its model runs layer by layer.

A layer here is pre-norm attention then an MLP (dense, or a mixture of experts), each block's output optionally
normed (Gemma 3's sandwich) and scaled (Granite) before its residual add.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvflow.layers.attention import PagedAttention
from kvflow.layers.rotary import RotaryEmbedding


class NotNative(Exception):
    """What keeps a model off the native step (the reason is logged at boot)."""


@dataclass(frozen=True)
class NativeAttention:
    qkv: nn.Module                 # the fused q/k/v projection (its bias, if any, is added by the step)
    o: nn.Module
    q_norm: nn.Module | None       # per head, or over the whole projection (`qk_whole`: OLMoE)
    k_norm: nn.Module | None
    qk_whole: bool
    heads: int
    kv_heads: int
    head_dim: int
    paged: PagedAttention          # its KV cache, softmax scale and sliding window
    rotary: RotaryEmbedding        # the tables this layer rotates q and k with


@dataclass(frozen=True)
class NativeLayer:
    attention: NativeAttention
    input_norm: nn.Module          # before attention
    mlp_in_norm: nn.Module         # before the MLP
    gate_up: nn.Module | None = None       # a dense MLP's fused gate/up and down projections
    down: nn.Module | None = None
    intermediate: int = 0
    moe: nn.Module | None = None           # a mixture of experts (layers/moe.py's SparseMoE) in place of the MLP
    attn_out_norm: nn.Module | None = None   # on the attention's output before its residual add (Gemma 3)
    mlp_out_norm: nn.Module | None = None    # on the MLP's output before its residual add (Gemma 3)
    residual_scale: float = 1.0            # each block's output times this before its residual add (Granite)


@dataclass(frozen=True)
class NativeDecoder:
    layers: list[NativeLayer]
    final_norm: nn.Module
    hidden_act: str                # the dense MLPs' gate activation, by config name
    input_embeddings: Callable[[torch.Tensor], torch.Tensor]   # token ids -> what the first layer reads
