"""Weight-only quantization: int8 or float8 (e4m3) weights with one scale per output channel.

Computed at load from the checkpoint's weights. The matmul dequantizes one matrix at a time just before
use (the full-precision copy lives only in cache) and applies the scale to the output, which equals
scaling the weights: y[:, n] = s[n] * sum_k x[:, k] q[n, k]. Reading int8/fp8 weights moves a quarter of the
bytes of float32 (half of bfloat16) from memory, which is what bounds small-batch decoding on CPUs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {"int8": 127.0, "fp8": 448.0}
HEAD_CHUNK_ROWS = 4096     # the LM head is dequantized in slices that fit in cache


def quantize_rows(weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (quantized [N, K], float32 scale [N]) with per-row (output channel) absmax scaling."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / _QMAX[method]).clamp(min=1e-12)
    q = w / scale[:, None]
    q = q.round().clamp(-127, 127).to(torch.int8) if method == "int8" else q.to(torch.float8_e4m3fn)
    return q, scale


def _dequant_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)


class QuantizedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, method: str):
        super().__init__()
        q, scale = quantize_rows(linear.weight, method)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _dequant_matmul(x, self.qweight, self.scale)
        return y + self.bias if self.bias is not None else y


class QuantizedEmbedding(nn.Module):
    """A quantized embedding table that can also serve as the (tied) LM head via `project`."""

    def __init__(self, embedding: nn.Embedding, method: str, dtype: torch.dtype):
        super().__init__()
        q, scale = quantize_rows(embedding.weight, method)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.view(torch.uint8)[ids].view(self.qweight.dtype)   # CPU cannot index fp8 directly
        return rows.to(self.dtype) * self.scale[ids, None].to(self.dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([_dequant_matmul(hidden, q, s) for q, s in
                          zip(self.qweight.split(HEAD_CHUNK_ROWS), self.scale.split(HEAD_CHUNK_ROWS))], dim=-1)


class QuantizedHead(QuantizedEmbedding):
    """An untied LM head (nn.Linear [vocab, hidden]) stored quantized."""

    def __init__(self, linear: nn.Linear, method: str, dtype: torch.dtype):
        nn.Module.__init__(self)
        q, scale = quantize_rows(linear.weight, method)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.dtype = dtype


def quantize_model(model: nn.Module, method: str, dtype: torch.dtype) -> None:
    """Swap the model's linear layers, embedding and LM head for quantized ones, in place."""
    if method not in QUANT_DTYPES:
        raise ValueError(f"quantization must be one of {', '.join(QUANT_DTYPES)}, got {method!r}")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                head = name == "lm_head"
                setattr(module, name, QuantizedHead(child, "int8", dtype) if head else QuantizedLinear(child, method))
            elif isinstance(child, nn.Embedding):
                # the embedding (and tied LM head) is int8 in both modes: e4m3's 3-bit mantissa costs the
                # small embedded model >3% perplexity there, where vLLM would keep it unquantized
                setattr(module, name, QuantizedEmbedding(child, "int8", dtype))
