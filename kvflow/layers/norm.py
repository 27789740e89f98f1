"""RMSNorm, computed in float32 whatever the activation dtype (as Hugging Face does)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in float32 by torch's one fused op (bit-equal to the five-op form, ~30%
        # faster at decode sizes); the weight multiplies in the activation dtype, as Hugging Face does
        normed = F.rms_norm(x.float(), x.shape[-1:], None, self.eps)
        return self.weight * normed.to(x.dtype)
