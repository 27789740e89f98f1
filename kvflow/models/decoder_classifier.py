"""A decoder as a reranker (Qwen3ForSequenceClassification and the like): llama.py's decoder whose last position's
hidden state goes through a one-label score head instead of the LM head.

The head is the checkpoint's `score.weight`, or, as vLLM builds Qwen3-Reranker's from `--hf-overrides
'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
"is_original_qwen3_reranker": true}'`, rows of the causal LM's head: two tokens give the row of the second minus
the first's, so the score's sigmoid is the softmax over the two tokens' logits, P(second); one token gives its row.
The LM head is dropped once the rows are taken (nothing samples).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from kvflow.distributed.parallel_state import TensorParallel
from kvflow.kernels.plan import KernelPlan
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.model_config import ModelConfig


class DecoderForSequenceClassification(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel | None = None,
                 kernels: KernelPlan | None = None):
        if tp is not None and tp.size > 1:
            raise ValueError(f"{cfg.architecture} does not run with tensor_parallel_size > 1 yet")
        super().__init__(cfg, max_positions, tp, kernels)
        if not cfg.classifier_token_ids:
            self.lm_head = None         # the checkpoint's score head stands in its place
        # a buffer, not a parameter: the decoder's loader checks that the checkpoint fills every parameter, and this
        # is written after it (from LM head rows, or the checkpoint's score.weight)
        self.register_buffer("score_weight", torch.zeros(1, cfg.hidden_size))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg, score = self.config, {}

        def decoder_weights():
            for name, tensor in weights:
                if name == "score.weight":
                    score["weight"] = tensor
                elif not (name.startswith("lm_head") and not cfg.classifier_token_ids):
                    yield name, tensor

        super().load_weights(decoder_weights())
        if cfg.classifier_token_ids:
            head = (self.embed_tokens if self.lm_head is None else self.lm_head).weight
            rows = head[list(cfg.classifier_token_ids)].float()
            weight = rows[1:] - rows[:1] if len(rows) == 2 else rows
            self.lm_head = None
        elif "weight" in score:
            weight = score["weight"]
        else:
            raise ValueError(f"{cfg.architecture}: the checkpoint has no score.weight; a causal LM's folder needs "
                             "--hf-overrides with classifier_from_token to score from its head")
        if tuple(weight.shape) != (1, cfg.hidden_size):
            raise ValueError(f"{cfg.architecture}: score head of shape {tuple(weight.shape)}, expected one label")
        self.score_weight.copy_(weight)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] last-position states (the final norm's output) -> [rows, 1] float32 logits."""
        return F.linear(pooled.float(), self.score_weight.float())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError(f"{self.config.architecture} scores; it samples nothing")
