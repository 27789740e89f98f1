"""Small batches read bfloat16 weights; large batches multiply in float32.

On a CPU without native bf16 matrix units (AVX2: no AVX-512-BF16, no AMX) float32 is the fast compute type
for batched steps, but a step of a few rows is bound by reading the weights from DRAM, not by arithmetic.
There a bfloat16 copy of each matrix halves the bytes read: one row ran the model's linears and LM head in
34 ms in bf16 against 91 ms in fp32 on the 2-core dev machine, while at 32 rows bf16 (emulated) took 568 ms
against 256 (docs/performance.md, `benchmarks/linear_weight_formats.py`, 2026-11-30). So each linear layer keeps both copies and picks
by the number of rows: this costs 50% more weight memory and makes a request's numerics depend on how many
others share its step (as bf16 inference does anyway); `dtype=float32` keeps exact float32 everywhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.layers.swap import swap_matrices

SMALL_BATCH_ROWS = 4      # at 8 rows the two formats tie on the dev machine; below, bf16 wins by up to 3.6x


class DualPrecisionLinear(nn.Module):
    def __init__(self, linear: nn.Linear, max_rows: int):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("weight_bf16", linear.weight.detach().to(torch.bfloat16))
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x.to(torch.bfloat16), self.weight_bf16).to(x.dtype)
        return y + self.bias if self.bias is not None else y


class DualPrecisionEmbedding(nn.Module):
    """The embedding table, plus a bf16 copy used when it serves as the (tied) LM head for a few rows."""

    def __init__(self, table: nn.Embedding | nn.Linear, max_rows: int):
        super().__init__()
        self.weight = table.weight
        self.register_buffer("weight_bf16", table.weight.detach().to(torch.bfloat16))
        self.max_rows = max_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] > self.max_rows:
            return F.linear(hidden, self.weight)
        return F.linear(hidden.to(torch.bfloat16), self.weight_bf16).float()


def enable_small_batch_bf16(model: nn.Module, max_rows: int = SMALL_BATCH_ROWS) -> None:
    """Give every linear layer, the embedding and the LM head a bf16 copy for steps of <= max_rows rows."""
    swap_matrices(model, linear=lambda layer: DualPrecisionLinear(layer, max_rows),
                  table=lambda table: DualPrecisionEmbedding(table, max_rows))
