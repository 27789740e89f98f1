"""Replacing a loaded model's weight matrices in place: how quantization and the small-batch bf16 copies
put their own modules where the model has `nn.Linear` layers and vocabulary tables."""
from __future__ import annotations

from typing import Callable

from torch import nn


def swap_matrices(model: nn.Module, linear: Callable[[nn.Linear], nn.Module],
                  table: Callable[[nn.Embedding | nn.Linear], nn.Module]) -> None:
    """Every `nn.Linear` becomes `linear(layer)`; the embedding and an untied LM head (`lm_head`, which is a
    vocabulary table used for projection) become `table(module)`."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Embedding) or (isinstance(child, nn.Linear) and name == "lm_head"):
                setattr(module, name, table(child))
            elif isinstance(child, nn.Linear):
                setattr(module, name, linear(child))
