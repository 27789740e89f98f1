"""LoRA on a (possibly fused) projection, for every row of a step at once: one batched path whatever mix of
adapters and base rows the step holds, added on top of the base layer's output (float, int8, int4 or kvflow's
native kernels alike: the base layer is not touched).

A projection of P pieces (qkv_proj: q, k, v; gate_up_proj: gate, up; o_proj and down_proj: one) keeps every slot's
adapter in two stacked matrices, S slots and rank R (`max_lora_rank`; smaller ranks are zero-padded):

    lora_a [in, P*S*R]    column block (p, s) holds piece p's A^T of the adapter in slot s
    lora_b [P*S*R, out]   row block (p, s) holds scale * B^T, written only into piece p's output columns

(kvflow keeps B per piece, [S*R, width of piece p], which is the same without B's zero blocks: the pieces one
after another in one flat buffer `lora_b`, where `lora_pieces` [P, 3] holds each piece's output offset, width and
start), and a step's per-token mask M [T, S*R] (1.0 in the R columns of the token's slot, zeros for a token of no
adapter) gives the whole term as

    xa = (x @ lora_a).view(T, P, S*R) * M[:, None, :];   out[:, piece p] += xa[:, p] @ B of piece p

Only the pieces some adapter may target get a term (`--lora-target-modules`, default all of the family's).
Static shapes and no per-row or per-adapter Python: the compiled decode graphs take it as it is, and a base row's
delta is exactly zero. Where kvflow's native kernels run in float32, one op of theirs computes the same term reading
only each row's own slot (kernels/ops.py's lora_add; measured on a 2-core Xeon, q and v of the embedded model's
qkv_proj at one row: 15 us a call, against 85 us for the masked matmuls padded to batch-invariant tiles below). The
stacked matrices are buffers written in place between steps (`set_slot`), so a compiled graph reads them live. The
mask is built once per step by the runner (`AttentionMetadata.lora_mask`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels import ops
from kvflow.kernels.plan import KernelPlan


class LoRAStack(nn.Module):
    """`pieces`: (output column offset, width) of each adapted piece of the base layer's output (e.g. q and v of
    qkv_proj when only those are targeted)."""

    def __init__(self, in_features: int, pieces: list[tuple[int, int]], max_loras: int, max_rank: int,
                 kernels: KernelPlan | None = None):
        super().__init__()
        self.pieces = [tuple(p) for p in pieces]
        self.num_pieces = len(pieces)
        self.max_loras = max_loras
        self.max_rank = max_rank
        # where the base model's kernels make a row's result independent of what shares its step (the plan's
        # kvflow kernels for attention and norms): the LoRA term is too (_invariant_mm)
        self.batch_invariant = kernels is not None and kernels.native_norms
        # kvflow's kernel computes the term (ops.lora_add: each row its own slot only, batch invariant) where the
        # plan's native kernels run in float32
        self.native = kernels is not None and kernels.native_lora
        # any slot holds an adapter that adapts this layer: eager steps skip the term otherwise (a compiled graph
        # always computes it: it is traced before any adapter exists). Private: not copied into the compiler's model
        self._active = False
        self._slots_in_use: set[int] = set()
        cols = self.num_pieces * max_loras * max_rank
        self.register_buffer("lora_a", torch.zeros(in_features, cols), persistent=False)
        # one B per piece, [S*R, width], one after another: no zero blocks (a fused B would be block diagonal)
        starts = [max_loras * max_rank * sum(width for _, width in self.pieces[:p]) for p in range(self.num_pieces)]
        self.register_buffer("lora_b", torch.zeros(max_loras * max_rank * sum(w for _, w in self.pieces)),
                             persistent=False)
        self.register_buffer("lora_pieces", torch.tensor([[offset, width, start] for (offset, width), start in
                                                          zip(self.pieces, starts)], dtype=torch.int64).view(-1, 3),
                             persistent=False)
        self._b_starts = starts

    def piece_b(self, p: int) -> torch.Tensor:
        """Piece p's B, [S*R, width] (a view of `lora_b`)."""
        width = self.pieces[p][1]
        start = self._b_starts[p]
        return self.lora_b[start:start + self.max_loras * self.max_rank * width].view(-1, width)

    def add_to(self, out: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`out` (the base layer's output for `x`) plus the LoRA term of every row's slot; `mask`: [T, S*R] of the
        step (AttentionMetadata.lora_mask)."""
        if self.native:
            return ops.lora_add(out, x, self.lora_a, self.lora_b, self.lora_pieces, mask, self.max_loras)
        T = x.shape[0]
        mm = _invariant_mm if self.batch_invariant else torch.mm
        xa = mm(x, self.lora_a).view(T, self.num_pieces, -1) * mask[:, None, :]
        if self.num_pieces == 1 and self.pieces[0] == (0, out.shape[1]):
            return out + mm(xa.view(T, -1), self.piece_b(0))
        out = out.clone()
        for p, (offset, width) in enumerate(self.pieces):      # static: the layer's pieces, not rows or adapters
            out[:, offset:offset + width] += mm(xa[:, p], self.piece_b(p))
        return out

    @torch.no_grad()
    def set_slot(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor] | None], scale: float) -> None:
        """Put one adapter's (A [r, in], B [width, r]) per piece (None: the adapter leaves that piece alone) into
        `slot`; every piece None clears the slot."""
        S, R = self.max_loras, self.max_rank
        for p in range(self.num_pieces):
            start = (p * S + slot) * R
            b_all = self.piece_b(p)
            self.lora_a[:, start:start + R].zero_()
            b_all[slot * R:(slot + 1) * R].zero_()
            ab = pieces[p] if p < len(pieces) else None
            if ab is not None:
                a, b = ab
                r = a.shape[0]
                self.lora_a[:, start:start + r].copy_(a.t())
                b_all[slot * R:slot * R + r].copy_(b.t() * scale)
        if any(ab is not None for ab in pieces):
            self._slots_in_use.add(slot)
        else:
            self._slots_in_use.discard(slot)
        self._active = bool(self._slots_in_use)


# _invariant_mm: rows in tiles of TILE, the reduction in chunks of at most CHUNK summed in order. Measured with MKL
# (torch 2.13, 2-core Xeon with AVX-512): a plain [T, K] @ [K, N] gives a row different bits for different T
# (another kernel for one row than for many; K = 1536 split over threads), while a bmm of fixed [TILE, <= 768]
# tiles gives every row the bits it gets alone, on 1 or 2 threads, for every shape of the LoRA terms of the embedded
# model (K 64-1536, N 16-3072).
TILE = 8
CHUNK = 768


def _invariant_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w with each row's result independent of the other rows and of the thread count."""
    T, K = x.shape
    pad = (-T) % TILE
    tiles = (T + pad) // TILE
    out = None
    for start in range(0, K, CHUNK):        # a fixed, static loop (K is a layer's width), not over rows
        part_w = w[start:start + CHUNK]
        part_x = x[:, start:start + CHUNK] if K > CHUNK else x
        if pad:
            part_x = F.pad(part_x, (0, 0, 0, pad))
        part = torch.bmm(part_x.reshape(tiles, TILE, -1), part_w.expand(tiles, *part_w.shape))
        out = part if out is None else out + part
    return out.view(-1, w.shape[1])[:T]


def lora_mask(token_slots: torch.Tensor, max_loras: int, max_rank: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, S*R]: 1.0 in the R columns of each token's slot, all zeros for a token of no adapter (slot -1)."""
    col_slot = torch.arange(max_loras * max_rank) // max_rank
    return (col_slot[None, :] == token_slots[:, None]).to(dtype)
