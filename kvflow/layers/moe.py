"""A mixture-of-experts MLP, batched the way the step is: a router picks each row's top-k experts and weights, the
step's (row, expert) pairs are grouped by expert (one stable sort by expert id), and each expert that any row chose
multiplies all of its rows in one call; experts no row chose are not read (at batch 1, only the top-k's weights are).

Each expert is an ordinary module of two `nn.Linear`s (fused gate/up and down), so quantization, the small-batch bf16
copies and a GGUF's own codes reach the experts as they reach every other matrix (`quantize_model`,
`layers/swap.py`): under kvflow's kernels each row of an expert's call is computed alone.

Where kvflow's kernels multiply every expert (`use_native_kernels`, called by the runner once the weights are
quantized; SiLU experts in any of kernels/formats.py's weight formats), each kind of matrix of all the experts is stacked into one
buffer and the whole grouping, the experts' matmuls, SiLU and the weighted sum run in one native call
(`ops.moe_experts`, kernels/csrc/moe.c), after the router's own (`ops.moe_route`): no Python per
expert, and a graph a whole-step compile can trace (the grouping happens inside the call). The runner's native
decoder step (runner/native_step.py) makes the same two calls, so both give the same bits.

Batch invariance: a row's output bits depend on that row alone where the expert matmuls do (kvflow's kernels):
- the router's logits are one small float matmul done in blocks of `ROUTER_ROWS` rows of the same shape (in torch),
  or each row's dot products in one fixed order (kernels/csrc/moe.c), so a row's logits do not depend on how many rows
  the step has;
- the k expert outputs of a row are summed in the row's own top-k order (highest weight first), one add at a time,
  whatever order the experts ran in.

The routers, as transformers computes them (float32 probabilities):
  softmax_topk               softmax over all experts, then the top k; renormalised when `norm_topk_prob`
                             (Qwen3-MoE, OLMoE)
  softmax_topk_renormalized  the same, always renormalised (Mixtral)
  topk_softmax               the top k logits, then a softmax over those k (GraniteMoE)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels import ops

ROUTERS = ("softmax_topk", "softmax_topk_renormalized", "topk_softmax")
ROUTER_ROWS = 8      # the router's matmul runs on blocks of this many rows (the last one padded)


def blocked_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T computed as a batch of [ROUTER_ROWS, K] blocks: every call multiplies blocks of one shape, so a
    row's result does not depend on how many rows came with it (a plain matmul's kernel choice does)."""
    t = x.shape[0]
    blocks = -(-t // ROUTER_ROWS)
    if blocks * ROUTER_ROWS != t:
        x = torch.cat([x, x.new_zeros(blocks * ROUTER_ROWS - t, x.shape[1])])
    return torch.matmul(x.view(blocks, ROUTER_ROWS, -1), weight.t()).view(-1, weight.shape[0])[:t]


class Router(nn.Module):
    """The gate: [num_experts, hidden] logits weights (kept float: llama.cpp never quantizes ffn_gate_inp, and a
    plain parameter, not an `nn.Linear`, so no quantization swaps it)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, kind: str, norm_topk_prob: bool):
        super().__init__()
        if kind not in ROUTERS:
            raise ValueError(f"expert router {kind!r} is not supported ({', '.join(ROUTERS)})")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k, self.kind, self.norm_topk_prob = top_k, kind, norm_topk_prob
        self.rule = ROUTERS.index(kind)      # kernels/csrc/kernels.h's ROUTE_* for the same rule

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, k], expert ids [T, k]), highest weight first."""
        logits = blocked_linear(x, self.weight.to(x.dtype)).float()
        if self.kind == "topk_softmax":
            top, ids = logits.topk(self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), ids
        top, ids = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.norm_topk_prob or self.kind == "softmax_topk_renormalized":
            top = top / top.sum(dim=-1, keepdim=True)
        return top, ids


class Expert(nn.Module):
    """One expert's gated MLP: act(x @ gate.T) * (x @ up.T) @ down.T, gate and up fused into one matrix."""

    def __init__(self, hidden_size: int, intermediate_size: int, act):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SparseMoE(nn.Module):
    """The router and its experts (`gate`, `experts`: the checkpoint's names, after loader.canonical_experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, router: str,
                 norm_topk_prob: bool, act):
        super().__init__()
        self.num_experts, self.top_k, self.intermediate_size = num_experts, top_k, intermediate_size
        self.gate = Router(hidden_size, num_experts, top_k, router, norm_topk_prob)
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size, act) for _ in range(num_experts))
        self.native = False         # the experts stacked for one native call (use_native_kernels)
        self.gate_up_bits = self.down_bits = 0

    def forward(self, x: torch.Tensor, meta=None) -> torch.Tensor:
        if self.native:
            rows = x.reshape(-1, x.shape[-1])
            weights, ids = ops.moe_route(rows, self.gate.weight, self.top_k, self.gate.rule, self.gate.norm_topk_prob)
            y = ops.moe_experts(rows, ids, weights, self.gate_up_codes, self.gate_up_scale, self.gate_up_minimum,
                                self.gate_up_bits, self.down_codes, self.down_scale, self.down_minimum, self.down_bits,
                                self.intermediate_size)
            return y.to(x.dtype).view(x.shape)
        weights, ids = self.gate(x)
        return self.combine(x, self.run_experts(x, ids), weights)

    def use_native_kernels(self) -> bool:
        """Stack the experts for `ops.moe_experts` where kvflow's kernels multiply all of them (every expert's two
        matrices held in a weight format (`native_matrix`: Int4Linear on kvflow's kernels, NativeQ8Linear), one format
        per kind, no bias) and
        their activation is SiLU (the one the native call computes); the expert modules are then dropped, their
        weights living on only in the stacks. False (nothing changed) otherwise."""
        if self.native:
            return True
        if not self.experts or any(e.act is not F.silu for e in self.experts):
            return False
        stacks = {}
        for kind in ("gate_up", "down"):
            layers = [getattr(e, f"{kind}_proj") for e in self.experts]
            found = [_native_codes(layer) for layer in layers]
            if any(f is None for f in found) or len({(bits, *(tuple(t.shape) + (t.dtype,) for t in ts))
                                                     for bits, ts in found}) != 1:
                return False
            bits = found[0][0]
            codes, scale, minimum = (torch.stack([ts[i] for _, ts in found]) for i in range(3))
            stacks[kind] = bits, codes, scale, minimum
        for kind, (bits, codes, scale, minimum) in stacks.items():
            setattr(self, f"{kind}_bits", bits)
            self.register_buffer(f"{kind}_codes", codes)
            self.register_buffer(f"{kind}_scale", scale)
            self.register_buffer(f"{kind}_minimum", minimum)
        self.experts = nn.ModuleList()
        self.native = True
        return True

    def run_experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every (row, choice) pair's expert output, [T, k, hidden]: the pairs sorted by expert id (stable: rows in
        step order within an expert), one call per expert that has any."""
        t, k = ids.shape
        if t == 1:      # a decode step of one row: its k experts in turn, nothing to group (the same bits)
            return torch.stack([self.experts[e](x) for e in ids[0].tolist()], dim=1)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // k
        out = x.new_empty(t * k, x.shape[1])
        start = 0
        for expert, n in enumerate(counts):
            if n:
                pairs = order[start:start + n]
                out.index_copy_(0, pairs, self.experts[expert](x.index_select(0, rows[start:start + n])))
                start += n
        return out.view(t, k, -1)

    @staticmethod
    def combine(x: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j weight[j] * output[j] over a row's choices, added in its top-k order (fixed per row)."""
        w = weights.to(x.dtype)
        total = outputs[:, 0] * w[:, 0:1]
        for j in range(1, outputs.shape[1]):
            total = total + outputs[:, j] * w[:, j:j + 1]
        return total


def _native_codes(layer: nn.Module) -> tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """(code bits, (codes, scale, minimum)) of a matrix kvflow's kernels multiply (minimum: an empty float32
    tensor for a format that has none), or None."""
    matrix = layer.native_matrix() if hasattr(layer, "native_matrix") and layer.bias is None else None
    if matrix is None:
        return None
    fmt, codes, scale, minimum = matrix
    return fmt.bits, (codes, scale, minimum)
