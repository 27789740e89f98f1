"""A layer that keeps state per request instead of a KV entry per token: a hybrid model's convolution, Gated DeltaNet
or Mamba2 mixer. Each declares its state tensors per slot (`state_shapes`); the model runner allocates them, one slot
per live request plus the slots prefix-cache checkpoints and speculative snapshots take, within the KV cache's memory
budget, and binds them here (`bind_state`), as it gives attention layers their K/V tensors. A step's rows find their
slots through `AttentionMetadata.state` (kernels/recurrent.py's `StateBatch`); the scheduler's `StateCache`
(core/state_cache.py) decides which slot each request holds.
"""
from __future__ import annotations

import torch
from torch import nn

from kvflow.layers.native_layers import NotNative


class RecurrentLayer(nn.Module):
    """Base of the mixers with per-request state. `states[name]` is [slots, *shape] once bound."""

    def __init__(self):
        super().__init__()
        self.states: dict[str, torch.Tensor] = {}

    def state_shapes(self, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape of one slot, dtype) of each state tensor, for a step computing in `dtype` (a convolution
        window is kept in it; a recurrent matrix is float32 whatever it is)."""
        raise NotImplementedError

    def bind_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.states = tensors

    def bound_states(self) -> dict[str, torch.Tensor]:
        """`states`, for the native step's description (which points at them): NotNative before the runner bound
        them."""
        if not self.states:
            raise NotNative(f"a {type(self).__name__} whose state slots are not allocated (the runner binds them)")
        return self.states

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        return sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
                   for shape, dt in self.state_shapes(dtype).values())
