"""Compiled decode steps (kvflow/runner/compiled_decode.py) against eager ones, on a tiny random model: the same
greedy tokens, padding rows that stay in the scratch block, and an eager fallback when compiling fails; eager
steps while a bucket compiles (a race once lost there), a clean exit during a compile, and a warm second start."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels import build
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
@pytest.mark.slow
@pytest.mark.parametrize("dtype,num_prompts,max_tokens", [("float32", 3, 40), ("bfloat16", 4, 16)])
def test_compiled_decode_gives_the_eager_greedy_tokens_and_padding_stays_in_the_scratch_block(tiny_dir, dtype,
                                                                                              num_prompts, max_tokens):
    prompts = PROMPTS[:num_prompts]
    eager = make_llm(tiny_dir, dtype, eager=True)
    expected, expected_alone = tokens(eager, prompts, max_tokens), tokens(eager, prompts[:1], max_tokens)
    llm = make_llm(tiny_dir, dtype, eager=False)
    scratch = llm.engine.runner.scratch_block
    assert written_blocks(llm) <= {scratch}     # nothing ran yet but, at most, padding rows
    assert tokens(llm, prompts, max_tokens) == expected                 # bucket 4
    assert tokens(llm, prompts[:1], max_tokens) == expected_alone       # bucket 1
    assert llm.engine.runner.compiled_decode.steps >= 2 * (max_tokens - 1)
    llm.engine.kv_cache_manager.check()
    # the same workload writes the same request blocks; padding rows write only the scratch block
    assert written_blocks(llm) - {scratch} == written_blocks(eager)


@pytest.fixture
def cold_caches(tmp_path, monkeypatch):
    """Empty kvflow and Inductor caches (the compiler process inherits the environment)."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "kvflow"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path


@pytest.mark.slow
def test_a_failing_compile_falls_back_to_eager_steps(tiny_dir, cold_caches, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/bin/false")          # Inductor's C++ compiler: every compile fails
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enforce_eager=False,
                  compile_batch_sizes=BUCKETS)
        compiled = llm.engine.runner.compiled_decode
        assert not compiled.wait(timeout=300) and compiled.failed
        assert tokens(llm, PROMPTS[:1]) == tokens(make_llm(tiny_dir, "float32", eager=True), PROMPTS[:1])
    assert compiled.steps == 0 and not compiled.ready
    assert sum("every step runs eagerly" in r.getMessage() for r in caplog.records) == 1


@pytest.fixture(scope="module")
def shared_cold_caches(tmp_path_factory):
    """Caches that start empty, shared by the race test (which fills them) and the warm-start test."""
    root = tmp_path_factory.mktemp("compile-caches")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFLOW_CACHE_DIR", str(root / "kvflow"))
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
        yield root


@pytest.mark.slow
def test_eager_steps_while_a_bucket_compiles_are_unharmed(tiny_dir, shared_cold_caches):
    """Issue 23: compiling on a thread of the serving process patched torch.nn.Module.__call__ while it traced,
    so an eager step at that moment died (NameError: module is not installed as a submodule). Steps of 2 rows
    run eagerly (above the only bucket) all through a cold compile, with short pauses (the compiler runs at a low
    priority and needs some CPU), and give the eager tokens; then steps of 1 row run compiled."""
    expected = tokens(make_llm(tiny_dir, "float32", eager=True), PROMPTS[:2], 8)
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enforce_eager=False,
              compile_batch_sizes=(1,))
    compiled = llm.engine.runner.compiled_decode
    rounds = 0
    while not compiled.wait(timeout=0) and not compiled.failed:
        assert tokens(llm, PROMPTS[:2], 8) == expected
        rounds += 1
        time.sleep(0.02)
    assert rounds >= 3 and not compiled.failed and compiled.compile_seconds[1] > 0
    alone = tokens(make_llm(tiny_dir, "float32", eager=True), PROMPTS[:1], 8)
    assert tokens(llm, PROMPTS[:1], 8) == alone and compiled.steps == 7
    llm.shutdown()


@pytest.mark.slow
def test_a_second_start_loads_the_saved_graphs_without_compiling(tiny_dir, shared_cold_caches):
    settings = dict(dtype="float32", max_model_len=256, enforce_eager=False, compile_batch_sizes=(1,))
    first = LLM(str(tiny_dir), kv_cache_memory="16MiB", **settings)     # compiles (unless the race test did)
    assert first.engine.runner.compiled_decode.wait(timeout=600)
    first.shutdown()
    again = LLM(str(tiny_dir), kv_cache_memory="64MiB", **settings)     # another KV cache size: the block
    warm = again.engine.runner.compiled_decode                          # count is a dynamic dimension
    assert warm.ready == {1} and warm.compile_seconds == {1: 0.0}        # before any wait: loaded at start
    assert again.engine.stats().compiled_decode_buckets_ready == 1
    alone = tokens(make_llm(tiny_dir, "float32", eager=True), PROMPTS[:1], 8)
    assert tokens(again, PROMPTS[:1], 8) == alone and warm.steps == 7 and not warm.failed
    again.shutdown()


@pytest.mark.slow
def test_the_process_exits_cleanly_while_it_compiles(tiny_dir, cold_caches):
    """Issue 23: `kvflow generate` printed its answer, then aborted (terminate called without an active
    exception, status 134) while the compile thread was inside Inductor. The compiler is a child process now,
    killed at shutdown."""
    for _ in range(2):
        run = subprocess.run([sys.executable, "-m", "kvflow.cli", "generate", "Hello", "--model", str(tiny_dir),
                              "--max-tokens", "4", "--dtype", "float32", "--max-model-len", "256",
                              "--kv-cache-memory", "16MiB"], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        assert run.returncode == 0, run.stderr[-2000:]
        assert "terminate called" not in run.stderr
    assert not list((cold_caches / "kvflow" / "compiled_decode").glob("*.bin"))   # it exited mid-compile


def test_enforce_eager_and_buckets_are_serve_flags():
    import argparse

    from kvflow.config import EngineConfig
    from kvflow.server.cli import add_config_flags
    parser = argparse.ArgumentParser()
    add_config_flags(parser, EngineConfig)
    args = parser.parse_args(["--enforce-eager", "--compile-batch-sizes", "8", "1", "2"])
    config = EngineConfig(enforce_eager=args.enforce_eager, compile_batch_sizes=args.compile_batch_sizes)
    assert config.enforce_eager and config.compile_batch_sizes == (1, 2, 8)


@pytest.mark.slow
def test_small_steps_on_fewer_threads_use_their_compiled_graphs(tiny_dir):
    """small_step_threads (what a server sets): Inductor bakes the thread count into a graph, so each bucket is
    compiled with the count its steps run on."""
    threads = torch.get_num_threads()
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enforce_eager=False,
              compile_batch_sizes=BUCKETS, small_step_threads=1)
    runner = llm.engine.runner
    assert runner.compiled_decode.wait(timeout=600) and not runner.compiled_decode.failed
    assert runner.threads_for(1) == 1 and runner.threads_for(64) == runner.threads == threads
    out = tokens(llm, PROMPTS[:1]) + tokens(llm, PROMPTS)
    assert not runner.compiled_decode.failed          # a graph run on other threads would fail its guards
    assert runner.compiled_decode.steps == 2 * 15 and all(len(t) == 16 for t in out)
    torch.set_num_threads(threads)


def test_the_graph_cache_keeps_the_most_recently_used_and_this_engines_own(tmp_path):
    from kvflow.runner.compiled_decode import prune_saved_graphs
    files = []
    for i in range(10):
        f = tmp_path / f"{i}.bin"
        f.write_bytes(b"x")
        os.utime(f, (1000 + i, 1000 + i))               # 9 is the most recently used
        files.append(f)
    (tmp_path / "compile_worker.log").write_text("kept")
    prune_saved_graphs(tmp_path, keep={files[0]}, most=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.bin", "7.bin", "8.bin", "9.bin", "compile_worker.log"]
    prune_saved_graphs(tmp_path / "missing", keep=set())         # no folder yet: nothing to do


@pytest.mark.slow
@pytest.mark.parametrize("native", [True, False], ids=["kvflow-kernel", "sdpa"])
def test_compiled_decode_keeps_gemma3s_sliding_window(tmp_path, native, monkeypatch):
    """A random Gemma 3 (window 16, 5 local : 1 global): decode steps past the window, compiled, give the eager
    tokens, with kvflow's attention kernel (its window argument) and with the SDPA path (its sliding mask input)."""
    if not native:
        monkeypatch.setenv("KVFLOW_NATIVE_KERNELS", "0")
    path = make_tiny_hf_model(tmp_path / "gemma3", family="gemma3", seed=5)
    prompts = [PROMPTS[2][:20]]          # 20 tokens: every decode step attends past the window
    expected = tokens(make_llm(path, "float32", eager=True), prompts, 12)
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enforce_eager=False,
              compile_batch_sizes=(1,))
    assert llm.engine.runner.native_attention == (native and build.usable())
    compiled = llm.engine.runner.compiled_decode
    assert compiled.wait(timeout=600) and not compiled.failed
    assert tokens(llm, prompts, 12) == expected and compiled.steps == 11
    llm.shutdown()
