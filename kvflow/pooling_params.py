"""PoolingParams: a pooling request (an embedding, or a text pair's score), beside SamplingParams as vLLM has it. A
request that carries one samples nothing: the engine computes its prompt (prefill only, in the same continuous
batch as generation; an encoder's prompt whole in one step) and hands back the sums of its final hidden states over
the positions the engine's pooling picks (`last`: the last prompt position; `mean`: every one; `cls`: the first),
with how many positions each sum covers; a score model's runner hands back its head's logits instead.

The frontend finishes the output here (`output`): an embedding is the sum over the count, then (by default, as
vLLM's embedding runners and a sentence-transformers Normalize module) L2-normalised; a score is the logit through
the model's activation (sigmoid for a one-label cross-encoder, as vLLM and sentence-transformers' CrossEncoder),
unless `use_activation` is off.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# torch.nn.functional.normalize's default eps, which vLLM's embedding pooler uses: x / max(||x||, eps)
NORMALIZE_EPS = 1e-12
TASKS = ("embed", "score")


@dataclass(frozen=True)
class PoolingParams:
    normalize: bool = True     # embed: L2-normalise the pooled vector (vLLM's `normalize`, later `use_activation`)
    task: str = "embed"        # "embed": the prompt's vector; "score": the model's relevance score of a text pair
    # score: the sigmoid on the logit (the default of a one-label cross-encoder, whose folder may say Identity:
    # the frontend resolves it with the model's); off: the raw logit
    use_activation: bool = True
    # a text pair's prompt: token_type_ids are 1 from this position on (the second text), 0 before it; None: all 0
    # (vLLM's compressed_token_type_ids). Only encoders read token types.
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"PoolingParams.task must be one of {', '.join(TASKS)}, got {self.task!r}")

    def output(self, pooled_sum: np.ndarray, num_positions: int) -> list[float]:
        """The request's output from what the engine pooled: an embedding's vector, or a score as [score]."""
        if self.task == "score":
            logit = float(pooled_sum[0])
            return [sigmoid(logit) if self.use_activation else logit]
        return self.embedding(pooled_sum, num_positions)

    def embedding(self, pooled_sum: np.ndarray, num_positions: int) -> list[float]:
        """The request's vector from the sum of its pooled hidden states (float64) over `num_positions`."""
        vector = pooled_sum / max(num_positions, 1)
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), NORMALIZE_EPS)
        return vector.tolist()


def sigmoid(x: float) -> float:
    """1 / (1 + e^-x), without overflow for large |x|."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)
