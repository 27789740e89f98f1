"""What kvflow's native decoder step computes, as each model family describes its own layers: plain data over the
family's modules (their weights stay where they are), so the runner's native step (runner/native_step.py) reads a
description instead of knowing each family by type. A family whose layers are not one of these shapes says why
with `NotNative`, and its model runs layer by layer.

A layer here is a pre-norm mixer then an MLP (dense, or a mixture of experts), each block's output optionally
normed (Gemma 3's sandwich) and scaled (Granite) before its residual add. The mixer is attention (its output gated
on Qwen3.5; without rotation on Granite 4.0 H) or, in a hybrid, a recurrent layer over the step's state slots: LFM2's
short convolution, Qwen3.5's Gated DeltaNet or Granite 4.0 H's Mamba2.
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
    rotary: RotaryEmbedding | None   # the tables this layer rotates q and k with; None: no position embedding (NoPE)
    output_gate: bool = False      # q's rows hold per head D query then D gate values; out = o(attn * sigmoid(gate))


@dataclass(frozen=True)
class NativeShortConv:
    """LFM2's gated short convolution: out_proj(C * conv(B * x)), in_proj's rows B, C, x (each `hidden`)."""
    in_proj: nn.Module
    out_proj: nn.Module
    conv_weight: torch.Tensor      # [hidden, K] float32
    conv_state: torch.Tensor       # [slots, K - 1, hidden] float32: the layer's state (layers/recurrent_state.py)


@dataclass(frozen=True)
class NativeGatedDeltaNet:
    """Qwen3.5's Gated DeltaNet (models/qwen3_5.py says what it computes)."""
    in_qkvz: nn.Module             # rows: q, k, v (the convolution's channels), then z
    in_ba: nn.Module               # rows: b, then a (Hv each)
    out_proj: nn.Module
    conv_weight: torch.Tensor      # [2 Hk dk + Hv dv, K] float32
    conv_state: torch.Tensor       # [slots, K - 1, channels] float32
    recurrent_state: torch.Tensor  # [slots, Hv, dk, dv] float32
    A_log: torch.Tensor            # [Hv] float32
    dt_bias: torch.Tensor          # [Hv] float32
    norm_weight: torch.Tensor      # [dv] float32: the gated output norm's
    norm_eps: float
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    out_order: torch.Tensor | None   # the value columns out_proj reads, in its order (a GGUF's: qwen3_5.py); None: as is


@dataclass(frozen=True)
class NativeMamba2:
    """Granite 4.0 H's Mamba2 mixer (models/granite_hybrid.py says what it computes)."""
    in_proj: nn.Module             # rows: z, then x B C (the convolution's channels), then dt
    out_proj: nn.Module
    conv_weight: torch.Tensor      # [H P + 2 G N, K] float32
    conv_bias: torch.Tensor | None
    conv_state: torch.Tensor       # [slots, K - 1, channels] float32
    ssm_state: torch.Tensor        # [slots, H, P, N] float32
    A_log: torch.Tensor            # [H] float32
    dt_bias: torch.Tensor
    D: torch.Tensor
    norm_weight: torch.Tensor      # [H P] float32: the gated output norm's
    norm_eps: float
    norm_group: int                # its group of channels
    heads: int                     # H
    head_dim: int                  # P
    groups: int                    # G: the B/C groups
    state_size: int                # N
    time_step_limit: tuple[float, float]


@dataclass(frozen=True)
class NativeLayer:
    attention: NativeAttention | None      # None: the layer's mixer is `recurrent`
    input_norm: nn.Module          # before attention
    mlp_in_norm: nn.Module         # before the MLP
    gate_up: nn.Module | None = None       # a dense MLP's fused gate/up and down projections
    down: nn.Module | None = None
    intermediate: int = 0
    moe: nn.Module | None = None           # a mixture of experts (layers/moe.py's SparseMoE) in place of the MLP
    attn_out_norm: nn.Module | None = None   # on the attention's output before its residual add (Gemma 3)
    mlp_out_norm: nn.Module | None = None    # on the MLP's output before its residual add (Gemma 3)
    residual_scale: float = 1.0            # each block's output times this before its residual add (Granite)
    # a hybrid's recurrent mixer, in attention's place
    recurrent: NativeShortConv | NativeGatedDeltaNet | NativeMamba2 | None = None


@dataclass(frozen=True)
class NativeDecoder:
    layers: list[NativeLayer]
    final_norm: nn.Module
    hidden_act: str                # the dense MLPs' gate activation, by config name
    input_embeddings: Callable[[torch.Tensor], torch.Tensor]   # token ids -> what the first layer reads
