"""Compiled decode steps (kvflow/runner/compiled_decode.py) against eager ones, on a tiny random model: the same
greedy tokens, padding rows that stay in the scratch block, and an eager fallback when compiling fails."""
from __future__ import annotations

import logging

import pytest
import torch

from kvflow import LLM, SamplingParams
from tiny_models import make_tiny_hf_model

BUCKETS = (1, 4)          # two small graphs keep the test short
PROMPTS = [[(i * 37 + j) % 40000 + 10 for j in range(5 + 9 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-compiled"))


def make_llm(path, dtype: str, eager: bool) -> LLM:
    llm = LLM(str(path), dtype=dtype, max_model_len=256, kv_cache_memory="16MiB", enforce_eager=eager,
              compile_batch_sizes=BUCKETS)
    compiled = llm.engine.runner.compiled_decode
    if eager:
        assert compiled is None
    else:
        assert compiled.wait(timeout=600) and not compiled.failed
    return llm


def tokens(llm: LLM, prompts, max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)  # contexts cross a block
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def written_blocks(llm: LLM) -> set[int]:
    cache = llm.engine.runner.model.attention_layers[0].k_cache
    return set(torch.nonzero(cache.flatten(1).abs().sum(1)).flatten().tolist())


# float32: 3 requests, so bucket 4 runs one padding row per step; 40 tokens, identical. bfloat16: 4 requests, 16
# tokens: Inductor folds the residual add into the matmul (addmm) and rounds to bf16 once where eager rounds twice,
# and at token 32 one request of this random model flips a near-tie (106 vs 40269) a step early.
@pytest.mark.parametrize("dtype,num_prompts,max_tokens", [("float32", 3, 40), ("bfloat16", 4, 16)])
def test_compiled_decode_gives_the_eager_greedy_tokens_and_padding_stays_in_the_scratch_block(tiny_dir, dtype,
                                                                                              num_prompts, max_tokens):
    prompts = PROMPTS[:num_prompts]
    eager = make_llm(tiny_dir, dtype, eager=True)
    expected, expected_alone = tokens(eager, prompts, max_tokens), tokens(eager, prompts[:1], max_tokens)
    llm = make_llm(tiny_dir, dtype, eager=False)
    scratch = llm.engine.runner.scratch_block
    assert written_blocks(llm) == {scratch}         # the warm-up ran the graphs on padding rows only
    assert tokens(llm, prompts, max_tokens) == expected                 # bucket 4
    assert tokens(llm, prompts[:1], max_tokens) == expected_alone       # bucket 1
    assert llm.engine.runner.compiled_decode.steps >= 2 * (max_tokens - 1)
    llm.engine.kv_cache_manager.check()
    # the same workload writes the same request blocks; padding rows write only the scratch block
    assert written_blocks(llm) - {scratch} == written_blocks(eager)


def test_a_failing_compile_falls_back_to_eager_steps(tiny_dir, monkeypatch, caplog):
    def broken_compile(model, **kw):
        def graph(*args):
            raise RuntimeError("no C++ compiler")
        return graph
    monkeypatch.setattr("kvflow.runner.compiled_decode.torch.compile", broken_compile)
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enforce_eager=False,
                  compile_batch_sizes=BUCKETS)
        compiled = llm.engine.runner.compiled_decode
        assert not compiled.wait(timeout=60) and compiled.failed
        assert tokens(llm, PROMPTS[:1]) == tokens(make_llm(tiny_dir, "float32", eager=True), PROMPTS[:1])
    assert compiled.steps == 0
    assert sum("every step runs eagerly" in r.getMessage() for r in caplog.records) == 1


def test_enforce_eager_and_buckets_are_serve_flags():
    import argparse

    from kvflow.config import EngineConfig
    from kvflow.server.cli import add_config_flags
    parser = argparse.ArgumentParser()
    add_config_flags(parser, EngineConfig)
    args = parser.parse_args(["--enforce-eager", "--compile-batch-sizes", "8", "1", "2"])
    config = EngineConfig(enforce_eager=args.enforce_eager, compile_batch_sizes=args.compile_batch_sizes)
    assert config.enforce_eager and config.compile_batch_sizes == (1, 2, 8)


def test_small_steps_on_fewer_threads_use_their_compiled_graphs(tiny_dir):
    """small_step_threads (what a server sets): dynamo guards on the thread count, so each bucket must be compiled
    with the count its steps run on, or every step would recompile."""
    threads = torch.get_num_threads()
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enforce_eager=False,
              compile_batch_sizes=BUCKETS, small_step_threads=1)
    runner = llm.engine.runner
    assert runner.compiled_decode.wait(timeout=600) and not runner.compiled_decode.failed
    assert runner.threads_for(1) == 1 and runner.threads_for(64) == runner.threads == threads
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out = tokens(llm, PROMPTS[:1]) + tokens(llm, PROMPTS)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs        # no recompilation
    assert runner.compiled_decode.steps > 0 and all(len(t) == 16 for t in out)
    torch.set_num_threads(threads)
