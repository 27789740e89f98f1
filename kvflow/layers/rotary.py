"""Rotary position embedding (rotate-half layout, as Hugging Face's Llama/Qwen), with Llama-3, linear and LongRoPE
(short factors: `ModelConfig` caps the context at the original length) scaling, and partial rotation (`rotary_dim`
< head_dim: the first `rotary_dim` dims of each head rotate, the rest pass, as Phi-4-mini)."""
from __future__ import annotations

import math

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind == "longrope":      # as transformers: 1 / (factor_i * theta^(2i/d)), the short factors
        factors = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        if len(factors) != head_dim // 2:
            raise ValueError(f"LongRoPE has {len(factors)} short factors for {head_dim // 2} rotary frequencies")
        return 1.0 / (factors * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
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
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: llama3, linear, longrope)")


def longrope_attention_factor(scaling: dict) -> float:
    """LongRoPE's cos/sin multiplier, as transformers computes it (`attention_factor`, else from the context ratio)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """The cos/sin tables, looked up once per step (`lookup`) and applied to every layer's q and k heads in one
    pass (`rotate`)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        head_dim = rotary_dim or head_dim          # the rotated part of each head
        inv_freq = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        half = head_dim // 2
        # rotate_half(x) * sin == swap_halves(x) * [-sin_lo, sin_hi]: the sign lives in the table, so a rotation
        # is one flip and three arithmetic ops (bit-equal to Hugging Face's neg + cat form)
        cos, sin = emb.cos(), emb.sin()
        if scaling and scaling.get("rope_type", scaling.get("type")) == "longrope":
            factor = longrope_attention_factor(scaling)
            cos, sin = cos * factor, sin * factor
        self.register_buffer("cos", cos, persistent=False)   # [max_positions, rotated dims] fp32
        self.register_buffer("sin_signed", torch.cat([-sin[:, :half], sin[:, half:]], dim=-1), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's (cos, signed sin), each [T, 1, head_dim] float32, shared by all layers."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, H, D] (any heads, e.g. q and k side by side); rotates in float32, returns x's dtype."""
        cos, sin_signed = rope
        T, H, D = x.shape
        R = cos.shape[-1]
        if R < D:       # partial rotation: the first R dims of each head rotate, the rest pass unchanged
            return torch.cat([RotaryEmbedding.rotate(x[..., :R], rope), x[..., R:]], dim=-1)
        xf = x.float()
        swapped = xf.view(T, H, 2, D // 2).flip(-2).view(T, H, D)
        return (xf * cos + swapped * sin_signed).to(x.dtype)
