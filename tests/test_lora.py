"""LoRA adapters, with real parts: adapters made by peft over a tiny random Llama (and over the embedded
model's shapes), kvflow's greedy tokens against transformers + peft in float32, through the server (mixed batches,
slot pressure, the run-time routes) and offline (`LLM(enable_lora=True)` + `LoRARequest`)."""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from kvflow import LLM, LoRARequest, SamplingParams
from kvflow.config import EngineConfig
from tiny_models import make_tiny_hf_model

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 8
# name -> (rank, targets, rsLoRA): different ranks and targets; "all" adapts every projection, with rsLoRA
ADAPTERS = {"qv": (8, ["q_proj", "v_proj"], False), "all": (16, ALL_SEVEN, True),
            "mlp": (4, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
            "kv": (2, ["k_proj", "v_proj", "down_proj"], False), "q": (6, ["q_proj", "up_proj"], False)}
THREE = ("qv", "all", "mlp")


def make_adapter(model, out: Path, rank: int, targets: list[str], seed: int, rslora: bool = False,
                 scale: float = 0.3, **lora_config) -> Path:
    """A PEFT adapter over `model` (an HF model: its weights are not saved) with random A and B large enough to
    change greedy output."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, target_modules=targets, use_rslora=rslora,
                                                  **lora_config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(out)
    peft_model.unload()     # the base model back as it was, for the next adapter
    return out


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(10, 40000, (n,), generator=g).tolist() for n in (5, 21, 40)]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("lora-base"), family="llama", seed=3)


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-adapters")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return {name: str(make_adapter(model, root / name, r, targets, seed=i + 1, rslora=rs))
            for i, (name, (r, targets, rs)) in enumerate(ADAPTERS.items())}


def hf_greedy(model, ids: list[int], n: int = MAX_TOKENS) -> list[int]:
    t = torch.tensor([ids])
    out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def reference(base_dir, adapters) -> dict[tuple[str | None, int], list[int]]:
    """transformers + peft (float32, unmerged): (adapter name or None, prompt index) -> greedy tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref = {}
    for name in (None, *ADAPTERS):
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval()
        for i, ids in enumerate(prompts()):
            ref[name, i] = hf_greedy(model, ids)
    # the adapters change the output (else the test proves nothing)
    for name in ADAPTERS:
        assert any(ref[name, i] != ref[None, i] for i in range(len(prompts()))), name
    return ref


class RuntimeUpdates:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING set while a server is built (the routes exist only then)."""

    def __enter__(self):
        self.old = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = self.old


@pytest.fixture(scope="module")
def server(base_dir, adapters):
    """Three adapters from the start, three slots, run-time updates allowed."""
    from kvflow.server.testing import ServerThread

    config = EngineConfig(model=str(base_dir), dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
                          served_model_name="base", enable_lora=True, max_loras=3, max_lora_rank=16)
    with RuntimeUpdates():
        thread = ServerThread(config, lora_modules=tuple(f"{n}={adapters[n]}" for n in THREE))
    with thread:
        yield thread


def complete(server, model: str, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    import httpx

    r = httpx.post(server.base_url + "/completions", timeout=120,
                   json={"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                         "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.slow
def test_mixed_batch_of_three_adapters_and_the_base_equals_transformers_peft_and_each_alone(server, reference):
    jobs = [(name, i) for name in (None, *THREE) for i in range(len(prompts()))]
    barrier = threading.Barrier(len(jobs))

    def run(job):
        name, i = job
        barrier.wait()
        return complete(server, name or "base", prompts()[i])

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        mixed = dict(zip(jobs, pool.map(run, jobs)))
    for job in jobs:
        assert mixed[job] == reference[job], f"adapter {job[0]}, prompt {job[1]} in a mixed batch"
    for job in jobs[::2]:       # alone (half of them: enough to show it, at half the time)
        assert complete(server, job[0] or "base", prompts()[job[1]]) == mixed[job], f"{job} alone"
    server.wait_idle()
    server.core("check")
    state = server.core("lora_state")
    assert sorted(a for a in state["slots"] if a) == [1, 2, 3] and state["num_loads"] == 3


def test_models_lists_each_adapter_with_the_base_as_parent(server, adapters):
    import httpx

    cards = {c["id"]: c for c in httpx.get(server.base_url + "/models").json()["data"]}
    assert cards["base"]["parent"] is None
    for name in THREE:
        assert cards[name]["parent"] == "base" and cards[name]["root"] == adapters[name]
    r = httpx.post(server.base_url + "/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_lora_requests_info_metric(server):
    import httpx

    complete(server, "qv", prompts()[0], 2)
    server.wait_idle()
    text = httpx.get(server.url + "/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="3"' in line and "running_lora_adapters=" in line and "waiting_lora_adapters=" in line
    assert float(line.rsplit(" ", 1)[1]) > 1e9       # the time of the update, as vLLM


def test_run_time_load_use_unload_reload_while_others_stream(server, adapters, reference, tmp_path):
    import httpx

    url = server.base_url
    done: dict[str, list[int]] = {}

    started = {m: threading.Event() for m in ("base", "qv", "fresh")}

    def stream(model: str, key: str):
        chunks = []
        with httpx.stream("POST", url + "/completions", timeout=120,
                          json={"model": model, "prompt": prompts()[2], "max_tokens": 48, "temperature": 0.0,
                                "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line)
                    started[key].set()
        if chunks[-1] == "data: [DONE]" and len(chunks) > 2:
            done[key] = chunks

    streams = [threading.Thread(target=stream, args=(m, m)) for m in ("base", "qv")]
    for t in streams:
        t.start()
    new_path = str(shutil.copytree(adapters["kv"], tmp_path / "kv-copy"))
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "fresh", "lora_path": new_path})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fresh' added successfully."
    assert complete(server, "fresh", prompts()[1]) == reference["kv", 1]
    assert any(c["id"] == "fresh" and c["parent"] == "base" for c in httpx.get(url + "/models").json()["data"])
    # unload while a request of it streams: it finishes; new requests for it are model_not_found
    late = threading.Thread(target=stream, args=("fresh", "fresh"))
    late.start()
    assert started["fresh"].wait(60)         # it is streaming
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "fresh"})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/completions", json={"model": "fresh", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # and back again
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "fresh", "lora_path": new_path})
    assert r.status_code == 200
    assert complete(server, "fresh", prompts()[1]) == reference["kv", 1]
    for t in (*streams, late):
        t.join(120)
    assert set(done) == {"base", "qv", "fresh"}


def test_run_time_errors_are_400s_naming_the_problem_and_the_server_keeps_serving(server, base_dir, adapters,
                                                                                  reference, tmp_path):
    import httpx
    from transformers import AutoModelForCausalLM

    url = server.base_url
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    big = make_adapter(model, tmp_path / "big", 32, ["q_proj"], seed=9)
    dora = make_adapter(model, tmp_path / "dora", 4, ["q_proj"], seed=9, use_dora=True)
    lm_head = make_adapter(model, tmp_path / "lm_head", 4, ["q_proj", "lm_head"], seed=9)
    other = make_tiny_hf_model(tmp_path / "wide", family="llama", seed=1, hidden_size=96)
    wrong = make_adapter(AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32), tmp_path / "wrong", 4,
                         ["q_proj"], seed=9)

    def load(name, path):
        return httpx.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})

    for name, path, words in (("x1", tmp_path / "missing", "path"), ("x2", big, "rank 32 is above --max-lora-rank 16"),
                              ("qv", adapters["kv"], "already"), ("x3", dora, "DoRA"),
                              ("x4", lm_head, "lm_head"), ("x5", wrong, "another base model")):
        r = load(name, path)
        assert r.status_code == 400, (name, r.text)
        assert words in r.json()["error"]["message"], (name, r.json())
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 400 and "never-loaded" in r.json()["error"]["message"]
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "qv", "lora_int_id": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_int_id"
    # vLLM's load_inplace: a refused replacement keeps the adapter that was there; an accepted one replaces it
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(big), "load_inplace": True})
    assert r.status_code == 400 and "rank 32" in r.json()["error"]["message"]
    assert complete(server, "qv", prompts()[0]) == reference["qv", 0]
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(adapters["all"]),
                                                     "load_inplace": True})
    assert r.status_code == 200, r.text
    assert complete(server, "qv", prompts()[0]) == reference["all", 0]
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(adapters["qv"]),
                                                     "load_inplace": True})
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health").status_code == 200
    assert complete(server, "all", prompts()[0]) == reference["all", 0]


@pytest.mark.slow
def test_slot_pressure_five_adapters_in_two_slots(base_dir, adapters, reference, monkeypatch):
    """40 concurrent requests over 5 adapters (and none without) with --max-loras 2 and --max-cpu-loras 3: each
    waits for a slot, none fails, each gets its own adapter's tokens; adapters are swapped in and read again after
    being evicted from the CPU cache. Run-time routes are off here (no VLLM_ALLOW_RUNTIME_LORA_UPDATING): 404."""
    import httpx

    from kvflow.server.testing import ServerThread

    config = EngineConfig(model=str(base_dir), dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
                          served_model_name="base", enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=16)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("KVFLOW_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    with ServerThread(config, lora_modules=tuple(f"{n}={p}" for n, p in adapters.items())) as server:
        names = list(ADAPTERS)
        jobs = [(names[k % 5], k % 3) for k in range(40)]
        with concurrent.futures.ThreadPoolExecutor(40) as pool:
            got = list(pool.map(lambda job: complete(server, job[0], prompts()[job[1]]), jobs))
        for job, tokens in zip(jobs, got):
            assert tokens == reference[job], job
        server.wait_idle()
        server.core("check")
        state = server.core("lora_state")
        # every adapter swapped in at least once; the scheduler runs a resident adapter's requests before swapping
        # (at least 5 reads: with 3 cached, one evicted may be needed again before the run ends, by arrival order)
        loads = state["num_loads"]
        assert state["num_swaps"] >= 5 and loads >= 5 and len(state["cpu"]) == 3
        # one evicted from the CPU cache is read again from its path
        evicted = next(i for i in range(1, 6) if i not in state["cpu"])
        assert complete(server, names[evicted - 1], prompts()[0]) == reference[names[evicted - 1], 0]
        assert server.core("lora_state")["num_loads"] == loads + 1
        r = httpx.post(server.base_url + "/load_lora_adapter", json={"lora_name": "z", "lora_path": adapters["q"]})
        assert r.status_code == 404


@pytest.mark.slow
def test_a_bad_lora_module_stops_the_start_naming_it(base_dir, tmp_path):
    from kvflow.server.testing import ServerThread

    config = EngineConfig(model=str(base_dir), dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
                          enable_lora=True)
    with pytest.raises(ValueError, match="bad.*does not exist"):
        ServerThread(config, lora_modules=(f"bad={tmp_path / 'nothing'}",))
    from kvflow.server.common.config import ServerConfig
    assert ServerConfig(lora_modules=('{"name": "a", "path": "/p", "base_model_name": "m"}', "b=/q")
                        ).lora_module_paths() == [("a", "/p"), ("b", "/q")]
    with pytest.raises(ValueError, match="name=PATH"):
        ServerConfig(lora_modules=("just-a-path",))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)


def test_offline_llm_with_lora_request_and_prefix_cache_per_adapter(base_dir, adapters, reference):
    """The same prompt under two adapters: each gets its own output (no shared KV); under the same adapter again it
    hits the prefix cache and gives the same tokens."""
    llm = LLM(str(base_dir), dtype="float32", max_model_len=256, kv_cache_memory="32MiB", enable_lora=True,
              max_loras=2)
    kv = llm.engine.kv_cache_manager
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    qv, mlp = (LoRARequest(n, i, adapters[n]) for i, n in ((1, "qv"), (2, "mlp")))
    ids = prompts()[2]                  # 40 tokens: two full blocks

    def gen(lora):
        hits = kv.prefix_cache_hits
        out = llm.generate([ids], params, lora_request=lora)[0].outputs[0].token_ids
        return out, kv.prefix_cache_hits - hits

    assert gen(qv) == (reference["qv", 2], 0)
    assert gen(mlp) == (reference["mlp", 2], 0)        # not qv's KV
    assert gen(None) == (reference[None, 2], 0)        # nor the base model's
    assert gen(qv) == (reference["qv", 2], 32)         # its own: two blocks
    # one LoRARequest per prompt, mixed in one call
    outs = llm.generate(prompts(), params, lora_request=[mlp, None, qv])
    assert [o.outputs[0].token_ids for o in outs] == [reference["mlp", 0], reference[None, 1], reference["qv", 2]]
    kv.check()
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(base_dir), dtype="float32", max_model_len=256, kv_cache_memory="16MiB").generate(
            [ids], params, lora_request=qv)


def test_lora_target_modules_limits_the_slots_to_those_projections(base_dir, adapters, reference):
    llm = LLM(str(base_dir), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enable_lora=True,
              lora_target_modules=("v_proj", "q_proj"))
    attn, mlp = llm.engine.runner.model.layers[0].self_attn, llm.engine.runner.model.layers[0].mlp
    assert attn.qkv_lora.num_pieces == 2 and attn.o_lora is None and mlp.gate_up_lora is None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([prompts()[1]], params, lora_request=LoRARequest("qv", 1, adapters["qv"]))
    assert out[0].outputs[0].token_ids == reference["qv", 1]
    with pytest.raises(ValueError, match="adapts k_proj, o_proj.*--lora-target-modules q_proj v_proj"):
        llm.generate([prompts()[1]], params, lora_request=LoRARequest("all", 2, adapters["all"]))
    with pytest.raises(ValueError, match="lora_target_modules"):
        EngineConfig(enable_lora=True, lora_target_modules=("q_proj", "lm_head"))


@pytest.mark.slow
def test_default_quantized_model_mixed_batch_equals_alone(tmp_path):
    """The embedded GGUF on its default path (its 4-bit codes in kvflow's kernels where they run): adapters made by
    peft over a Llama of its shapes change the output, and a mixed batch gives each request what it gets alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvflow.models.loader import default_model_path
    from kvflow.models.model_files import resolve_model_files

    cfg = resolve_model_files(default_model_path()).config
    hf_cfg = LlamaConfig(vocab_size=64, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    with torch.device("meta"):          # the base weights are never read: no time spent initialising them
        model = LlamaForCausalLM(hf_cfg)
    model = model.to_empty(device="cpu")
    a = make_adapter(model, tmp_path / "a", 16, ["q_proj", "v_proj"], seed=1, scale=0.1)
    b = make_adapter(model, tmp_path / "b", 8, ALL_SEVEN, seed=2, scale=0.05)
    del model
    llm = LLM(max_model_len=512, kv_cache_memory="64MiB", enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    texts = ["The capital of France is", "def fibonacci(n):"]
    loras = [None, LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))]
    jobs = [(p, lora) for p in texts for lora in loras]
    mixed = [o.outputs[0].token_ids for o in llm.generate([p for p, _ in jobs], params,
                                                          lora_request=[lora for _, lora in jobs])]
    alone = [llm.generate([p], params, lora_request=lora)[0].outputs[0].token_ids for p, lora in jobs]
    assert mixed == alone
    for k in range(0, len(jobs), 3):
        assert mixed[k + 1] != mixed[k] and mixed[k + 2] != mixed[k], texts[k // 3]


@pytest.mark.slow
def test_compiled_decode_steps_read_the_slots_live(base_dir, adapters, reference, monkeypatch):
    """Decode graphs traced with the LoRA terms present give the eager tokens, for adapters swapped in after the
    graph was compiled (the stacked weights are buffers read at every call)."""
    llm = LLM(str(base_dir), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enable_lora=True,
              max_loras=2, enforce_eager=False, compile_batch_sizes=(4,))
    compiled = llm.engine.runner.compiled_decode
    assert compiled.wait(timeout=600) and not compiled.failed
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for pair in (("qv", "all"), ("mlp", "kv")):
        loras = [None] + [LoRARequest(n, list(ADAPTERS).index(n) + 1, adapters[n]) for n in pair]
        before = compiled.steps
        outs = llm.generate([prompts()[1]] * 3, params, lora_request=loras)
        assert compiled.steps - before >= MAX_TOKENS - 1
        assert [o.outputs[0].token_ids for o in outs] == [reference[None, 1], reference[pair[0], 1],
                                                          reference[pair[1], 1]]
