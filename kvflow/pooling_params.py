"""PoolingParams: an embedding request, beside SamplingParams as vLLM has it. A request that carries one samples
nothing: the engine computes its prompt (prefill only, chunk by chunk, in the same continuous batch as generation)
and hands back the sums of its final hidden states over the positions the engine's `--pooling` picks (`last`: the
last prompt position; `mean`: every one), with how many positions each sum covers. The frontend adds the sums up
and finishes the vector here: the sum over the count, then (by default, as vLLM's embedding runners) L2-normalised.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# torch.nn.functional.normalize's default eps, which vLLM's embedding pooler uses: x / max(||x||, eps)
NORMALIZE_EPS = 1e-12


@dataclass(frozen=True)
class PoolingParams:
    normalize: bool = True     # L2-normalise the pooled vector (vLLM's `normalize`, later `use_activation`)

    def embedding(self, pooled_sum: np.ndarray, num_positions: int) -> list[float]:
        """The request's vector from the sum of its pooled hidden states (float64) over `num_positions`."""
        vector = pooled_sum / max(num_positions, 1)
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), NORMALIZE_EPS)
        return vector.tolist()
