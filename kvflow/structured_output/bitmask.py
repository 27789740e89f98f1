"""Token masks in the batched sampler: one bit per token, 32 tokens per int32 word, rows as in the batch.

Masks are filled on the CPU by llguidance's parallel executor (it releases the GIL), then unpacked and
applied with a handful of tensor ops on the logits' device: no Python loop over the vocabulary, and
only the constrained rows are read or written. A batch with no constrained row returns at once.
Logits wider than the grammar's vocabulary (the model's padded vocab) get -inf past it on constrained rows.

The engine may call fill_bitmask() while the model's forward pass runs (the mask depends only on the
tokens accepted so far) and apply_bitmask() once the logits are there; apply_structured_masks() does both.
"""
from __future__ import annotations

import sys
from typing import Sequence

import llguidance
import torch

from kvflow.structured_output.matcher import Matcher

assert sys.byteorder == "little", "unpack_bitmask reads int32 words as little-endian bytes"

_executor: llguidance.LLExecutor | None = None
_bit_index: dict[torch.device, torch.Tensor] = {}


def _get_executor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    return _executor


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 [rows, ceil(vocab/32)] CPU buffer (pinned when a GPU will read it)."""
    return torch.empty((rows, (vocab_size + 31) // 32), dtype=torch.int32, pin_memory=torch.cuda.is_available())


def fill_bitmask(matchers: Sequence[Matcher], bitmask: torch.Tensor) -> None:
    """bitmask[i] <- the allowed next tokens of matchers[i], all rows in parallel."""
    assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and bitmask.is_contiguous()
    assert len(matchers) <= bitmask.shape[0]
    _get_executor().unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(matchers)],
                                            bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] -> bool [R, min(vocab_size, 32 W)], True = allowed."""
    # Read the words as bytes (little-endian: byte j holds tokens 8j..8j+7), 4x less shifting than int32.
    shifts = _bit_index.get(bitmask.device)
    if shifts is None:
        shifts = _bit_index[bitmask.device] = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (bitmask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place: logits[rows[i]] gets -inf wherever bitmask[i] forbids the token. Other rows untouched."""
    if not len(rows):
        return
    allowed = unpack_bitmask(bitmask[: len(rows)].to(logits.device, non_blocking=True), logits.shape[1])
    width = allowed.shape[1]
    whole = len(rows) == logits.shape[0] and all(r == i for i, r in enumerate(rows))   # then no gather
    idx = None if whole else torch.as_tensor(rows, dtype=torch.long).to(logits.device)
    sub = logits if whole else logits[idx]
    sub[:, :width].masked_fill_(~allowed, float("-inf"))
    sub[:, width:] = float("-inf")   # padded model vocabulary: never a grammar token
    if not whole:
        logits[idx] = sub


def apply_structured_masks(logits: torch.Tensor, matchers: Sequence[Matcher | None],
                           bitmask: torch.Tensor | None = None) -> None:
    """In place on logits [N, V]: mask row i by matchers[i] where it is not None.

    `bitmask` is an optional reusable buffer with at least as many rows as there are matchers and
    ceil(grammar vocab / 32) words; without it one is allocated per call.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    active = [matchers[i] for i in rows]
    if bitmask is None:
        bitmask = allocate_bitmask(len(rows), active[0].vocab_size)
    fill_bitmask(active, bitmask)
    apply_bitmask(logits, bitmask, rows)
