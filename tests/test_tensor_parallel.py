"""Tensor parallelism on CPU (gloo): real worker processes, real collectives, real servers; no mocks.

TP=2 must give the same tokens as TP=1 in float32 (the embedded SmolLM2, whose 3 KV heads split unevenly,
and tiny random models), the server must answer the official client, and a worker's death must end the
engine with errors (in-flight request, /health 503, non-zero exit) instead of a hang.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.core.engine_core import EngineCore
from kvflow.core.messages import AddRequest
from kvflow.distributed.parallel_state import even_ranges
from kvflow.server.testing import ServerThread, free_port
from tiny_models import make_tiny_hf_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_even(tmp_path_factory):
    """4 heads, 2 KV heads, intermediate 128, vocabulary 49152: everything halves at TP=2."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("tp-even"), family="llama", seed=3)


@pytest.fixture(autouse=True)
def no_worker_left_behind():
    yield
    deadline = time.monotonic() + 10
    while any(p.name.startswith("kvflow-tp") for p in multiprocessing.active_children()):
        assert time.monotonic() < deadline, f"worker processes left: {multiprocessing.active_children()}"
        time.sleep(0.1)


# The configuration is gloo on CPU: pinned, so a one-GPU machine runs these tests too (NCCL would
# need a GPU per rank).
def core_config(path, **kw) -> EngineConfig:
    args = dict(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB", device="cpu")
    args.update(kw)
    return EngineConfig(**args)


def run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]):
    """Token ids and logprobs of every request, driving the core directly (no text: odd vocabularies are fine)."""
    tokens = {str(i): [] for i in range(len(prompts))}
    logprobs = {str(i): [] for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(AddRequest(str(i), p, sp))
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.new_logprobs or []
    core.kv_cache_manager.check()
    return [tokens[str(i)] for i in range(len(prompts))], [logprobs[str(i)] for i in range(len(prompts))]


def workload(n: int, seed: int = 0):
    """Prompts of 3-60 tokens, half of them sharing a 40-token prefix (prefix-cache hits); greedy and seeded
    sampling, with logprobs so the whole distribution is compared, not only the argmax."""
    import random
    rng = random.Random(seed)
    shared = [rng.randrange(100, 49000) for _ in range(40)]
    prompts, params = [], []
    for i in range(n):
        own = [rng.randrange(100, 49000) for _ in range(rng.randrange(3, 21))]
        prompts.append(shared + own if i % 2 else own * (1 + i % 3))
        if i % 3 == 2:
            params.append(SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=40, logprobs=3,
                                         ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=40, logprobs=3, ignore_eos=True))
    return prompts, params


def assert_same(expected, got, tol=1e-4):
    (tok_a, lp_a), (tok_b, lp_b) = expected, got
    assert tok_b == tok_a
    for per_req_a, per_req_b in zip(lp_a, lp_b):
        for a, b in zip(per_req_a, per_req_b):
            assert set(a) == set(b)
            assert all(abs(a[t] - b[t]) < tol for t in a), (a, b)


def compare_tp1_tp2(path, prompts, params, **kw):
    single = EngineCore(core_config(path, **kw))
    expected = run(single, prompts, params)
    core = EngineCore(core_config(path, tensor_parallel_size=2, **kw))
    try:
        assert core.runner.num_blocks == single.runner.num_blocks or "kv_cache_memory" in kw
        got = run(core, prompts, params)
        assert core.executor.workers[0][1].is_alive()
    finally:
        core.shutdown()
    assert core.executor.workers[0][1].exitcode == 0      # stopped when told, not killed
    assert_same(expected, got)
    return core


# ---- splitting ------------------------------------------------------------------------------------------------

def test_even_ranges_are_contiguous_and_as_even_as_possible():
    assert even_ranges(3, 2) == [(0, 2), (2, 3)]
    assert even_ranges(1536, 2) == [(0, 768), (768, 1536)]
    assert even_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_a_split_that_cannot_work_is_a_clear_error_before_any_process_starts(tiny_even):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot split this model: it has 4 attention "
                                         r"heads and 2 KV heads.*tensor_parallel_size <= 2"):
        EngineCore(core_config(tiny_even, tensor_parallel_size=3))
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("kw, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(tensor_parallel_size=3, nnodes=2, distributed_init_method="tcp://127.0.0.1:1234"), "multiple of nnodes"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, distributed_init_method="tcp://h:1"), "node_rank"),
    (dict(tensor_parallel_size=2, nnodes=2), "needs distributed_init_method"),
    (dict(tensor_parallel_size=2, distributed_init_method="127.0.0.1:1234"), "tcp://HOST:PORT"),
])
def test_bad_distributed_settings_are_value_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


# ---- TP=2 equals TP=1 ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_model_tp2_matches_tp1_with_chunked_prefill_prefix_hits_and_sampling(tiny_even):
    prompts, params = workload(16)
    # a 32-token budget prefills the longer prompts in chunks; 6 sequences at a time makes later ones wait
    core = compare_tp1_tp2(tiny_even, prompts, params, max_num_batched_tokens=32, max_num_seqs=6)
    assert core.kv_cache_manager.prefix_cache_hits > 0
    # each rank holds half of the heads, MLP columns and vocabulary
    sizes = core.runner.model.sizes
    assert (sizes.num_heads, sizes.num_kv_heads, sizes.intermediate_size, sizes.vocab_size) == (2, 1, 64, 24576)


@pytest.mark.slow
def test_uneven_split_tp2_matches_tp1(tmp_path):
    """3 KV heads (2 + 1 per rank, as SmolLM2), an odd MLP width and vocabulary: every split is uneven."""
    path = make_tiny_hf_model(tmp_path / "uneven", family="qwen2", seed=5, hidden_size=96, num_attention_heads=6,
                              num_key_value_heads=3, head_dim=16, intermediate_size=129, vocab_size=49155,
                              tie_word_embeddings=False)
    prompts, params = workload(6, seed=1)
    core = compare_tp1_tp2(path, prompts, params, kv_cache_memory="64MiB")
    sizes = core.runner.model.sizes
    assert (sizes.num_heads, sizes.num_kv_heads, sizes.intermediate_size, sizes.vocab_size) == (4, 2, 65, 24578)


@pytest.mark.slow
def test_quantized_weights_and_fp8_kv_cache_work_on_shards(tiny_even):
    """int8 layers are swapped in on each rank's shards; the embedding's masked lookup works on the int8 table.
    Not bit-identical to TP=1: o_proj / down_proj rows are split, so each shard gets its own per-row scale."""
    prompts, params = workload(6, seed=2)
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    single = EngineCore(core_config(tiny_even, quantization="int8", kv_cache_dtype="fp8"))
    core = EngineCore(core_config(tiny_even, quantization="int8", kv_cache_dtype="fp8", tensor_parallel_size=2))
    try:
        assert type(core.runner.model.embed_tokens).__name__ == "QuantizedEmbedding"
        got, expected = run(core, prompts, greedy)[0], run(single, prompts, greedy)[0]
    finally:
        core.shutdown()
    same_prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(got, expected)]
    assert sum(same_prefix) >= 0.8 * 24 * len(prompts), same_prefix


@pytest.mark.slow
def test_smollm2_tp2_greedy_matches_tp1(smol_llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "The three laws of motion are"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory="256MiB", tensor_parallel_size=2, device="cpu")
    try:
        assert llm.engine.runner.model.sizes.num_kv_heads == 2            # 3 KV heads: 2 on rank 0, 1 on rank 1
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.engine.shutdown()
    assert got == expected


# ---- serving ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_server_answers_the_openai_client_and_an_idle_worker_death_turns_health_503(tiny_even):
    config = core_config(tiny_even, tensor_parallel_size=2, served_model_name="tiny", max_model_len=512)
    tp1 = LLM(str(tiny_even), dtype="float32", max_model_len=512, kv_cache_memory="32MiB", device="cpu")
    expected = tp1.generate("Tensor parallel", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    with ServerThread(config) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
        whole = client.completions.create(model="tiny", prompt="Tensor parallel", max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert whole.choices[0].text == expected[0].outputs[0].text
        chunks = list(client.completions.create(model="tiny", prompt="Tensor parallel", max_tokens=20,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        assert chunks[-1].choices[0].finish_reason == "length"
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8, stream=True)
        assert len([c for c in chat if c.choices and c.choices[0].delta.content]) > 0
        server.wait_idle()
        server.core("check")

        os.kill(server.core("worker_pids")[0], signal.SIGKILL)            # the server is idle: the health check must notice
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "an idle server did not notice its dead worker"
            time.sleep(0.1)
        health = httpx.get(server.url + "/health").json()
        assert "rank 1" in health["error"]["message"] and "signal 9" in health["error"]["message"]
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert err.value.status_code == 503


def wait_healthy(proc, base: str, log: Path, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start:\n" + log.read_text()
        time.sleep(0.2)


def serve(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "kvflow.cli", "serve", *args], cwd=REPO, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def children(pid: int) -> set[int]:
    """Every descendant (the engine process, its workers, their helpers)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for c in task.read_text().split():
            found.add(int(c))
            try:
                found |= children(int(c))
            except OSError:     # already gone
                pass
    return found


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.slow
def test_killing_a_worker_mid_request_fails_the_request_and_the_server_exits_non_zero(tiny_even, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    proc = serve([str(tiny_even), "--device", "cpu", "--tensor-parallel-size", "2", "--port", str(port), "--host", "127.0.0.1",
                  "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "32MiB",
                  "--served-model-name", "tiny"], log)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, log)
        worker_pid = int(re.search(r"rank 1 of 2: worker pid (\d+)", log.read_text()).group(1))
        assert worker_pid in children(proc.pid)
        helpers = children(proc.pid)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt="warm up", max_tokens=4).choices[0].text is not None

        stream = client.completions.create(model="tiny", prompt="a long answer", max_tokens=450, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it), next(it)                             # the request is running
        t0 = time.monotonic()
        os.kill(worker_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="died"):
            for _ in it:
                pass
        assert proc.wait(60) == 1                      # the server stops itself, with an error
        assert time.monotonic() - t0 < 60
        out = log.read_text()
        assert "tensor-parallel worker rank 1" in out and "exiting: the engine loop died" in out
        deadline = time.monotonic() + 10                # no orphan left behind (the worker, multiprocessing's
        while not all(gone(pid) for pid in helpers):    # resource tracker)
            assert time.monotonic() < deadline, [Path(f"/proc/{p}/cmdline").read_text() for p in helpers
                                                 if not gone(p)]
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_two_nodes_on_one_machine_serve_and_stop_together(tiny_even, tmp_path):
    """Node 0 runs the server and rank 0, node 1 (`--node-rank 1`) only rank 1, over tcp://127.0.0.1:PORT."""
    port, rendezvous = free_port(), f"tcp://127.0.0.1:{free_port()}"
    common = [str(tiny_even), "--device", "cpu", "--tensor-parallel-size", "2", "--nnodes", "2", "--distributed-init-method",
              rendezvous, "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "32MiB"]
    log0, log1 = tmp_path / "node0.log", tmp_path / "node1.log"
    node1 = serve([*common, "--node-rank", "1"], log1)        # may start first: it waits for node 0
    node0 = serve([*common, "--node-rank", "0", "--port", str(port), "--host", "127.0.0.1",
                   "--served-model-name", "tiny"], log0)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(node0, base, log0)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="two machines", max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))
        tp1 = LLM(str(tiny_even), dtype="float32", max_model_len=512, kv_cache_memory="32MiB", device="cpu")
        assert text == tp1.generate("two machines", SamplingParams(temperature=0, max_tokens=12,
                                                                     ignore_eos=True))[0].outputs[0].text
        assert "no HTTP server on this node" in log1.read_text()
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(60) == 0
        assert node1.wait(60) == 0                   # told to stop by rank 0
        assert "rank 1: stop" in log1.read_text()
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
                p.wait()
