"""Weight-only quantization: int8 or float8 (e4m3) weights with one scale per output channel.

Computed at load from the checkpoint's weights. The matmul dequantizes one matrix at a time just before
use (the full-precision copy lives only in cache) and applies the scale to the output, which equals
scaling the weights: y[:, n] = s[n] * sum_k x[:, k] q[n, k]. Reading int8/fp8 weights moves a quarter of the
bytes of float32 (half of bfloat16) from memory, which is what bounds small-batch decoding on CPUs.

On CUDA GPUs with FP8 tensor cores (compute capability >= 8.9) and bfloat16 compute, fp8 layers instead run
`torch._scaled_mm`: activations are quantized per token (dynamic row-wise scale), weights keep their
per-channel scale, and the GPU multiplies in fp8 — what vLLM calls fp8 with dynamic per-token activation
scales. A start-up probe checks the kernel against the dequantizing path and falls back if it fails.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("kvflow")

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


def _fp8_scaled_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x @ (q * scale).T with both operands in fp8 on the GPU's tensor cores (row-wise scales)."""
    rows = x.reshape(-1, x.shape[-1])
    x_scale = (rows.abs().amax(dim=-1, keepdim=True).float() / _QMAX["fp8"]).clamp(min=1e-12)
    xq = (rows.float() / x_scale).clamp(-_QMAX["fp8"], _QMAX["fp8"]).to(torch.float8_e4m3fn)
    y = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=x.dtype)
    return y.view(*x.shape[:-1], q.shape[0])


def fp8_matmul_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """FP8 tensor cores (Ada / Hopper and later) and bf16 activations, which row-wise scaling requires."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


class QuantizedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, method: str):
        super().__init__()
        q, scale = quantize_rows(linear.weight, method)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.fp8_matmul = False      # set by quantize_model when the GPU multiplies fp8 natively

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_matmul:
            y = _fp8_scaled_matmul(x, self.qweight, self.scale)
        else:
            y = _dequant_matmul(x, self.qweight, self.scale)
        return y + self.bias if self.bias is not None else y


class QuantizedEmbedding(nn.Module):
    """A quantized [vocab, hidden] table: the embedding (lookups) and/or the LM head (`project`), tied or not."""

    def __init__(self, table: nn.Embedding | nn.Linear, method: str, dtype: torch.dtype):
        super().__init__()
        q, scale = quantize_rows(table.weight, method)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.view(torch.uint8)[ids].view(self.qweight.dtype)   # CPU cannot index fp8 directly
        return rows.to(self.dtype) * self.scale[ids, None].to(self.dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([_dequant_matmul(hidden, q, s) for q, s in
                          zip(self.qweight.split(HEAD_CHUNK_ROWS), self.scale.split(HEAD_CHUNK_ROWS))], dim=-1)


def _probe_fp8_matmul(layer: QuantizedLinear, dtype: torch.dtype) -> str | None:
    """None when torch._scaled_mm runs this layer and matches the dequantizing path, else why not."""
    x = torch.randn(5, layer.qweight.shape[1], device=layer.qweight.device, dtype=dtype)
    try:
        fast = _fp8_scaled_matmul(x, layer.qweight, layer.scale).float()
    except (RuntimeError, TypeError) as e:
        return f"torch._scaled_mm failed: {str(e).splitlines()[0]}"
    ref = _dequant_matmul(x, layer.qweight, layer.scale).float()
    err = ((fast - ref).norm() / ref.norm().clamp(min=1e-12)).item()
    return None if err < 0.1 else f"torch._scaled_mm differs from the reference by {err:.1%}"


def quantize_model(model: nn.Module, method: str, dtype: torch.dtype) -> str:
    """Swap the model's linear layers, embedding and LM head for quantized ones, in place.
    Returns how the quantized linear layers multiply (for the boot log)."""
    if method not in QUANT_DTYPES:
        raise ValueError(f"quantization must be one of {', '.join(QUANT_DTYPES)}, got {method!r}")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                head = name == "lm_head"
                setattr(module, name, QuantizedEmbedding(child, "int8", dtype) if head else QuantizedLinear(child, method))
            elif isinstance(child, nn.Embedding):
                # the embedding (and tied LM head) is int8 in both modes: e4m3's 3-bit mantissa costs the
                # small embedded model >3% perplexity there, where vLLM would keep it unquantized
                setattr(module, name, QuantizedEmbedding(child, "int8", dtype))
    how = _choose_matmul(model, method, dtype)
    log.info("quantization: %s", how)
    return how


def _choose_matmul(model: nn.Module, method: str, dtype: torch.dtype) -> str:
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if method != "fp8" or not linears:
        return f"{method} weights, dequantized per matrix before each matmul"
    device = linears[0].qweight.device
    if not fp8_matmul_supported(device, dtype):
        return "fp8 weights, dequantized per matrix before each matmul (no fp8 tensor cores / bf16 here)"
    problem = _probe_fp8_matmul(linears[0], dtype)
    if problem:
        log.warning("fp8: %s; dequantizing instead", problem)
        return "fp8 weights, dequantized per matrix before each matmul (the fp8 kernel failed its probe)"
    for layer in linears:
        layer.fp8_matmul = True
    return "fp8 weights and per-token fp8 activations, torch._scaled_mm on the GPU's fp8 tensor cores"
