"""`kvflow run-batch --ray`: a batch file sharded with Ray Data over replicas on a real two-node Ray cluster.

One cluster for the module (`ray start --head --num-cpus 1` and a second node of one CPU, on this machine:
tests/ray_cluster.py); the tiny random model of tests/test_run_batch.py, greedy. A file of chat, completions and
embeddings lines (and an unreadable one) is run half through `kvflow.ray.run_batch` (Python) and then whole through
the command into the same output, which resumes: every line is answered exactly once, the first run's lines kept
as they were, the output in input order, the bodies equal to one engine's `kvflow run-batch`. A second run has one
replica SIGKILLed mid-run (its PID from the cluster's actor table): Ray restarts it, its lines run again, and the
output is the same. Without Ray importable, `--ray` and `kvflow.ray.run_batch` fail at once naming the extra.

`--distributed-executor-backend ray` on the same cluster (VLLM_RAY_PG_STRATEGY=SPREAD: one rank on each node): TP=2
equal to TP=1 and to the `mp` backend token for token (tokens and logprobs), and a SIGKILLed rank ends the engine
with the `mp` backend's TensorParallelError.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ray_cluster import KILLER, REPO, RayCluster, env
from tiny_models import make_tiny_hf_model

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed (kvflow[ray])")

FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--enforce-eager",
         "--served-model-name", "tiny", "--no-progress"]
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enforce_eager=True,
              served_model_name="tiny")
WORDS = ["alpha", "kernel", "paged cache", "the river", "seven apples", "a quiet", "blue", "numbers: 3 5"]


def batch_lines(n: int = 40, max_tokens: int = 16) -> list[str]:
    lines = []
    for i in range(n):
        word = f"{WORDS[i % len(WORDS)]} {i}"
        if i % 3 == 0:
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"Say {word}"}],
                    "max_tokens": max_tokens, "temperature": 0}
            lines.append(json.dumps({"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": body}))
        elif i % 3 == 1:
            body = {"model": "tiny", "prompt": f"Once upon {word}", "max_tokens": max_tokens, "temperature": 0}
            lines.append(json.dumps({"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
                                     "body": body}))
        else:
            lines.append(json.dumps({"custom_id": f"embd-{i}", "method": "POST", "url": "/v1/embeddings",
                                     "body": {"model": "tiny", "input": f"vector of {word}"}}))
    lines.insert(5, '{"custom_id": "broken", "url": "/v1/completions", "body": {')     # unreadable: `line 6:`
    return lines


def run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=env(), **kw)


def run_batch(model, inp, out, *extra) -> subprocess.CompletedProcess:
    done = run(["-m", "kvflow.cli", "run-batch", str(model), "-i", str(inp), "-o", str(out), *FLAGS, *extra])
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def processed(done) -> tuple[int, int, int]:
    m = re.search(r"run-batch: (\d+) line\(s\) processed \((\d+) failed\), (\d+) skipped", done.stderr)
    assert m, done.stderr[-3000:]
    return tuple(int(x) for x in m.groups())


def read_output(path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def key(record: dict) -> str:
    if record["custom_id"] is not None:
        return record["custom_id"]
    return re.match(r"line \d+", record["error"]["error"]["message"]).group(0)


def comparable(record: dict) -> dict:
    """A result without what differs between any two runs: ids, timestamps, prefix-cache hits."""
    body = dict(record["response"]["body"])
    body.pop("id", None)
    body.pop("created", None)
    if isinstance(body.get("usage"), dict):
        body["usage"] = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return {"status": record["response"]["status_code"], "body": body}


def input_keys(lines: list[str]) -> list[str]:
    keys = []
    for lineno, text in enumerate(lines, 1):
        try:
            keys.append(json.loads(text)["custom_id"])
        except json.JSONDecodeError:
            keys.append(f"line {lineno}")
    return keys


@pytest.fixture(scope="module")
def cluster():
    c = RayCluster.start(nodes=2, cpus_per_node=1)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-ray"), family="llama", seed=7)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray-batch")
    lines = batch_lines()
    (d / "all.jsonl").write_text("\n".join(lines) + "\n")
    (d / "half.jsonl").write_text("\n".join(lines[:len(lines) // 2]) + "\n")
    return dict(dir=d, lines=lines, keys=input_keys(lines))


@pytest.fixture(scope="module")
def single_engine(model_path, files):
    """The same file through today's `kvflow run-batch` on one engine: what every Ray run must equal."""
    out = files["dir"] / "single.jsonl"
    run_batch(model_path, files["dir"] / "all.jsonl", out)
    return {key(r): comparable(r) for r in read_output(out)}


@pytest.fixture(scope="module")
def resumed(cluster, model_path, files):
    """The first half through the Python API, then the whole file through the command into the same output."""
    out = files["dir"] / "ray.jsonl"
    script = ("import sys; from kvflow.config import EngineConfig; from kvflow.ray import run_batch; "
              f"c = run_batch(sys.argv[1], sys.argv[2], EngineConfig(model=sys.argv[3], **{ENGINE!r}), "
              "address=sys.argv[4], replicas=2, batch_size=4); print('done', c.done, c.failed)")
    first = run(["-c", script, str(files["dir"] / "half.jsonl"), str(out), str(model_path), cluster.address])
    assert first.returncode == 0, first.stderr[-4000:]
    first_text = out.read_text()
    second = run_batch(model_path, files["dir"] / "all.jsonl", out, "--ray", cluster.address, "--replicas", "2",
                       "--ray-batch-size", "4", "--max-concurrency", "4")
    return dict(out=out, first=first, first_text=first_text, second=second)


@needs_ray
@pytest.mark.slow
def test_resumed_run_answers_every_line_once_in_input_order_equal_to_one_engine(resumed, files, single_engine):
    half = len(files["lines"]) // 2
    assert re.search(rf"done {half} 1\b", resumed["first"].stdout), resumed["first"].stdout   # `broken` fails
    assert processed(resumed["second"]) == (len(files["lines"]) - half, 0, half)
    records = read_output(resumed["out"])
    assert [key(r) for r in records] == files["keys"]          # each once, in input order
    for text in resumed["first_text"].splitlines():            # the first run's lines kept as written
        assert text in resumed["out"].read_text().splitlines()
    got = {key(r): comparable(r) for r in records}
    assert got == single_engine
    assert got["line 6"]["status"] == 400
    assert sum(1 for k in got if k.startswith("embd-")) == 13


@needs_ray
@pytest.mark.slow
def test_a_replica_killed_mid_run_is_restarted_and_no_line_is_lost_or_written_twice(cluster, model_path, files,
                                                                                    single_engine):
    out = files["dir"] / "killed.jsonl"
    killer = subprocess.Popen([sys.executable, "-c", KILLER, cluster.address, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env())
    try:
        assert json.loads(killer.stdout.readline() or "{}").get("event") == "ready", killer.communicate()[1][-3000:]
        done = run_batch(model_path, files["dir"] / "all.jsonl", out, "--ray", cluster.address, "--replicas", "2",
                         "--ray-batch-size", "2", "--max-concurrency", "2")
        events, err = killer.communicate(timeout=300)
    finally:
        if killer.poll() is None:
            killer.kill()
    events = [json.loads(x) for x in events.splitlines()]
    killed = [e for e in events if e["event"] == "killed"]
    assert killed, err[-3000:]
    assert 0 < killed[0]["written"] < len(files["lines"]), "not killed mid-run: nothing was tested"
    assert [e for e in events if e["event"] == "restarted"], (events, err[-3000:])
    assert processed(done) == (len(files["lines"]), 1, 0)
    records = read_output(out)
    assert [key(r) for r in records] == files["keys"]         # every line once, none lost
    assert {key(r): comparable(r) for r in records} == single_engine


def test_without_ray_the_flags_fail_at_once_naming_the_extra(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(batch_lines(3)) + "\n")
    hide = "import sys; sys.modules['ray'] = None; sys.modules['ray.data'] = None; "
    cli = run(["-c", hide + "from kvflow.cli import main; sys.exit(main(sys.argv[1:]))", "run-batch", "-i",
               str(inp), "-o", str(tmp_path / "out.jsonl"), "--ray", "--replicas", "2"])
    assert cli.returncode == 2, cli.stderr
    assert "pip install 'kvflow[ray]'" in cli.stderr and "Traceback" not in cli.stderr, cli.stderr
    assert not (tmp_path / "out.jsonl").exists()
    api = run(["-c", hide + "from kvflow.ray import run_batch\ntry:\n    run_batch(sys.argv[1], sys.argv[2])\n"
               "except ImportError as e:\n    print('ImportError:', e)", str(inp), str(tmp_path / "out.jsonl")])
    assert "ImportError:" in api.stdout and "pip install 'kvflow[ray]'" in api.stdout, api.stdout + api.stderr


def test_ray_flags_without_ray_are_refused(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(batch_lines(3)) + "\n")
    done = run(["-m", "kvflow.cli", "run-batch", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"),
                "--replicas", "2"])
    assert done.returncode == 2 and "--replicas only apply with --ray" in done.stderr, done.stderr


# ---- tensor parallelism over Ray (--distributed-executor-backend ray) --------------------------------------------
@pytest.fixture
def on_the_cluster(cluster, monkeypatch):
    """This process drives the cluster; SPREAD puts rank 1 on the other node (one CPU each: STRICT_PACK cannot)."""
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.setenv("VLLM_RAY_PG_STRATEGY", "SPREAD")
    return cluster


@needs_ray
@pytest.mark.slow
def test_tp2_over_ray_matches_tp1_and_the_mp_backend_token_for_token(on_the_cluster, model_path):
    from kvflow.core.engine_core import EngineCore
    from test_tensor_parallel import assert_same, core_config, run as run_core, workload

    prompts, params = workload(8)
    expected = run_core(EngineCore(core_config(model_path)), prompts, params)
    results = {}
    for backend in ("mp", "ray"):
        core = EngineCore(core_config(model_path, tensor_parallel_size=2, distributed_executor_backend=backend))
        try:
            results[backend] = run_core(core, prompts, params)
            worker = core.executor.workers[0][1]
            assert worker.is_alive()
            if backend == "ray":
                placement = core.executor.workers[0][0]
                assert placement.local_size == 1 and worker.node_id is not None      # alone on its node
        finally:
            core.shutdown()
        assert worker.exitcode == 0                   # stopped when told, not killed
        assert_same(expected, results[backend])
    assert results["ray"][0] == results["mp"][0]


@needs_ray
@pytest.mark.slow
def test_a_killed_ray_worker_ends_the_engine_with_the_mp_backends_error(on_the_cluster, model_path):
    from kvflow import SamplingParams
    from kvflow.core.engine_core import EngineCore
    from kvflow.core.messages import AddRequest
    from kvflow.executor.tensor_parallel import TensorParallelError
    from test_tensor_parallel import core_config

    core = EngineCore(core_config(model_path, tensor_parallel_size=2, distributed_executor_backend="ray"))
    try:
        pid = core.worker_pids()[0]
        core.add_request(AddRequest("long", list(range(100, 120)), SamplingParams(temperature=0, max_tokens=200,
                                                                                  ignore_eos=True)))
        for _ in range(3):
            core.step()                                 # the request is running
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"tensor-parallel worker rank 1 \(pid {pid}\) died"):
            while core.has_unfinished_requests():
                core.step()
        assert time.monotonic() - t0 < 30
        with pytest.raises(TensorParallelError):        # and stays failed (an idle engine's check too)
            core.executor.check_health()
    finally:
        t1 = time.monotonic()
        core.shutdown()
        assert time.monotonic() - t1 < 30


def test_the_ray_backend_without_ray_is_an_error_naming_the_extra():
    hide = "import sys; sys.modules['ray'] = None; "
    done = run(["-c", hide + "from kvflow.config import EngineConfig\ntry:\n    EngineConfig(tensor_parallel_size=2, "
                "distributed_executor_backend='ray')\nexcept ValueError as e:\n    print('ValueError:', e)"])
    assert "ValueError:" in done.stdout and "pip install 'kvflow[ray]'" in done.stdout, done.stdout + done.stderr
