"""dtype=auto on a CPU without native bf16 matmul: float32 compute, bf16 weight copies for steps of few rows."""
from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams, platform
from kvflow.layers.small_batch import SMALL_BATCH_ROWS, DualPrecisionEmbedding, DualPrecisionLinear

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or platform.cpu_has_fast_bf16(),
    reason="dtype=auto computes in bf16 here; the small-batch copies exist only where auto means float32")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "List three colors:",
           "Water boils at", "My favourite book is", "Dear team,", "In 1969, humans"]


@pytest.fixture(scope="module")
def auto_llm():
    # float weights: without quantization="none" a quantized GGUF is served from its own codes
    return LLM(dtype="auto", quantization="none", max_model_len=512, kv_cache_memory="64MiB")


@pytest.mark.slow
def test_auto_adds_bf16_copies_and_float32_does_not(auto_llm, smol_llm):
    kinds = {type(m) for m in auto_llm.engine.runner.model.modules()}
    assert DualPrecisionLinear in kinds and DualPrecisionEmbedding in kinds
    assert auto_llm.engine.runner.dtype == torch.float32
    exact = {type(m) for m in smol_llm.engine.runner.model.modules()}
    assert DualPrecisionLinear not in exact and DualPrecisionEmbedding not in exact
    # the copies are counted in the weights' memory: 1.5x float32's
    ratio = auto_llm.engine.runner.weights_bytes / smol_llm.engine.runner.weights_bytes
    assert 1.45 < ratio < 1.55


@pytest.mark.slow
def test_large_batches_stay_exact_float32(auto_llm, smol_llm):
    """Every step of 8 equal-length requests has more than SMALL_BATCH_ROWS rows: float32 throughout."""
    assert len(PROMPTS) > SMALL_BATCH_ROWS
    prompts = [smol_llm.tokenizer.encode(p)[:4] for p in PROMPTS]     # equal lengths: they finish together
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    exact = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    auto = [o.outputs[0].token_ids for o in auto_llm.generate(prompts, params)]
    assert auto == exact


@pytest.mark.slow
def test_small_batches_read_bf16_and_stay_close(auto_llm, smol_llm):
    """One request alone decodes on the bf16 copies: not bit-identical to float32, but nearly the same text."""
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    agree, differs = 0, False
    for p in PROMPTS:
        a = auto_llm.generate([p], params)[0].outputs[0]
        e = smol_llm.generate([p], params)[0].outputs[0]
        agree += a.token_ids == e.token_ids
        first_a, first_e = (next(iter(lp.values())) for lp in (a.logprobs[1], e.logprobs[1]))
        differs |= first_a != first_e
        if a.token_ids[:2] == e.token_ids[:2]:
            assert abs(first_a - first_e) < 0.1         # bf16 rounding, not a different model
    assert differs, "every logprob equal to float32's: the bf16 copies were not used"
    assert agree >= 6, f"greedy agreement with float32 on only {agree}/8 prompts"
