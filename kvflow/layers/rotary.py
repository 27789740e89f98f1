"""Rotary position embedding (rotate-half layout, as Hugging Face's Llama/Qwen), with Llama-3 scaling."""
from __future__ import annotations

import math

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: llama3, linear)")


class RotaryEmbedding(nn.Module):
    """The cos/sin tables, looked up once per step (`lookup`) and applied to every layer's q and k heads in one
    pass (`rotate`)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        half = head_dim // 2
        # rotate_half(x) * sin == swap_halves(x) * [-sin_lo, sin_hi]: the sign lives in the table, so a rotation
        # is one flip and three arithmetic ops (bit-equal to Hugging Face's neg + cat form)
        sin = emb.sin()
        self.register_buffer("cos", emb.cos(), persistent=False)   # [max_positions, head_dim] fp32
        self.register_buffer("sin_signed", torch.cat([-sin[:, :half], sin[:, half:]], dim=-1), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's (cos, signed sin), each [T, 1, head_dim] float32, shared by all layers."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, H, D] (any heads, e.g. q and k side by side); rotates in float32, returns x's dtype."""
        cos, sin_signed = rope
        T, H, D = x.shape
        xf = x.float()
        swapped = xf.view(T, H, 2, D // 2).flip(-2).view(T, H, D)
        return (xf * cos + swapped * sin_signed).to(x.dtype)
