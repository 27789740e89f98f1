"""The kernel plan (kernels/plan.py): one account, built at load and logged at boot, of which kernels compute
the model here and how many threads each step takes; the runner's steps take their threads from it."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels import build, ops
from kvflow.kernels.plan import SMALL_STEP_ROWS, KernelPlan


def plan(**kw) -> KernelPlan:
    fields = dict(device=torch.device("cpu"), isa="avx2", matmuls="m", native_attention=True, kernel_pool=True,
                  decode_step="native", why_not_native_step="", threads=4, small_step_threads=None,
                  frontend_shares_cores=False)
    return KernelPlan(**{**fields, **kw})


@pytest.mark.parametrize("kw, small, large", [
    ({}, (1, 4), (4, 4)),                                        # kvflow's pool: every core, torch's ops on one
    ({"small_step_threads": 2}, (1, 2), (4, 4)),
    ({"small_step_threads": 9}, (1, 4), (4, 4)),                 # never more than the process has
    ({"kernel_pool": False}, (4, 4), (4, 4)),
    ({"kernel_pool": False, "frontend_shares_cores": True}, (3, 3), (4, 4)),     # a core for the HTTP frontend
    ({"kernel_pool": False, "small_step_threads": 1}, (1, 1), (4, 4)),
    ({"device": torch.device("cuda", 0)}, (4, 4), (4, 4)),
])
def test_threads_per_step_by_rows(kw, small, large):
    p = plan(**kw)
    assert [p.step_threads(r) for r in (1, SMALL_STEP_ROWS)] == [small, small]
    assert p.step_threads(SMALL_STEP_ROWS + 1) == large


def test_the_cores_other_processes_leave_cap_every_step():
    assert plan().step_threads(1, cores=1) == (1, 1) and plan().step_threads(SMALL_STEP_ROWS + 1, cores=2) == (2, 2)
    assert plan(kernel_pool=False, frontend_shares_cores=True).step_threads(1, cores=1) == (1, 1)    # never 0
    assert plan().step_threads(SMALL_STEP_ROWS + 1, cores=8) == (4, 4)       # never more than the process has
    assert plan(device=torch.device("cuda", 0)).step_threads(1, cores=1) == (4, 4)


def test_the_default_engine_logs_its_plan_at_boot_and_its_steps_follow_it(caplog):
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = LLM(max_model_len=256, kv_cache_memory="16MiB", small_step_threads=1)
    runner = llm.engine.runner
    p = runner.plan
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernel plan:")]
    assert logged == [p.describe()]
    for part in ("matmuls:", "attention:", "decode steps:", "threads:"):
        assert f"\n  {part}" in logged[0]
    # the plan says what this machine runs: kvflow's kernels where they build (its ISA), the step path taken
    usable = build.usable()
    assert p.isa == (build.isa() if usable else None)
    assert p.native_attention == runner.native_attention == usable
    assert (p.decode_step == "native") == (runner.native_step is not None)
    assert p.decode_step in ("native", "layers")             # the suite runs eagerly (conftest): nothing compiles
    # a step's threads are the plan's: one row, then more rows than a small step has
    for prompts in (["Hi"], [f"Q{i}" for i in range(SMALL_STEP_ROWS + 1)]):
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0))
        free = runner.core_share.free if runner.core_share else None
        assert ops.threads() == p.step_threads(len(prompts), free)[1]
    assert p.step_threads(1) == (1, 1)           # small_step_threads=1, on the pool or not


def test_without_kvflows_kernels_the_plan_says_so(monkeypatch):
    monkeypatch.setenv("KVFLOW_NATIVE_KERNELS", "0")
    runner = LLM(max_model_len=256, kv_cache_memory="16MiB").engine.runner
    p = runner.plan
    assert p.isa is None and not p.native_attention and not p.kernel_pool and p.decode_step == "layers"
    assert "SDPA" in p.describe() and "no kvflow kernels" in p.describe()
    # torch's matmuls may round otherwise on another thread count: steps keep their threads whatever else runs
    assert not p.yields_cores and runner.core_share is None and "CoreShare" not in p.describe()


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.alone
def test_beside_busy_processes_steps_take_the_cores_they_leave_and_the_same_tokens():
    """Busy processes on every core but one: within a few seconds the engine's steps run on one thread; once they
    stop, on every thread again. The greedy tokens are the same throughout (the same bits on any thread count)."""
    llm = LLM(max_model_len=512, kv_cache_memory="16MiB")
    runner = llm.engine.runner
    cores = runner.core_share.cores
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = llm.generate(["The sea at night"], params)[0].outputs[0].token_ids

    def run_until(want: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert llm.generate(["The sea at night"], params)[0].outputs[0].token_ids == expected
            if ops.threads() == want and runner.step_threads(1)[1] == want:
                return
        pytest.fail(f"kernel threads {ops.threads()} after {timeout} s, expected {want}")

    run_until(min(cores, runner.threads))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores - 1)]
    try:
        run_until(1)
        assert runner.step_threads(SMALL_STEP_ROWS + 1) == (1, 1)       # big steps too: no OpenMP barrier waits
    finally:
        for p in busy:
            p.kill()
            p.wait()
    run_until(min(cores, runner.threads))
