"""The decoder step as one native call (runner/native_step.py over kernels/csrc/decoder_step.c). Where it builds (a
Llama-family, Gemma 3, mixture-of-experts or hybrid (LFM2, Qwen3.5, Granite 4.0 H) decoder whose every matmul, norm and attention is kvflow's
kernel, float32 compute, one rank, no LoRA) it is the default, and it gives the layer-by-layer path's bits: the same
tokens and the same logprobs, in steps that mix decodes with prefill chunks, for each KV element type it writes, each
weight format and family it takes (the hybrids' recurrent layers also under speculation, whose runs of rows continue
one state and snapshot it per draft, and from prefix-cache hits that restore state checkpoints), and on two threads
with pool workers made to stall. Everywhere else the layer-by-layer path serves (the fallback)."""
from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.kernels import build
from tiny_models import make_tiny_hf_model, write_gguf_from_hf

pytestmark = pytest.mark.skipif(
    not build.usable(),
    reason="kvflow's kernels cannot run on this machine (no AVX2/FMA or no C compiler): no native step to test")

TEXTS = ["The capital of France is", "def fibonacci(n):",
         "Write a long story about a lighthouse keeper who finds a map in a bottle, and tell it in detail. " * 3,
         "1, 2, 3, 4, 5,", "Why is the sky blue? " * 6]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)


def answers(llm: LLM, prompts) -> list:
    """Each prompt's tokens and every logprob reported (bit-equal floats: the same logits)."""
    outs = llm.generate(prompts, GREEDY)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def both_paths(monkeypatch, model: str | None, **kwargs) -> tuple[list, list]:
    """The same prompts on the native step and on the layer-by-layer path (KVFLOW_NATIVE_STEP=0), each engine
    with small chunks, so steps mix decodes and prefill chunks."""
    kwargs = dict(max_model_len=512, kv_cache_memory="64MiB", max_num_batched_tokens=40, **kwargs)
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("KVFLOW_NATIVE_STEP", native)
        with LLM(model, **kwargs) as llm:
            runner = llm.engine.runner
            assert (runner.native_step is not None) == (native == "1")
            prompts = [llm.tokenizer.encode(t) for t in TEXTS]
            results.append(answers(llm, prompts))
            if runner.native_step is not None:
                assert runner.native_step.steps >= 12       # every step ran natively
                assert runner.compiled_decode is None        # nothing left to compile
    assert max(len(p) for p in prompts) > 40
    return results[0], results[1]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16", "bfloat16", "float32"])
def test_the_default_engine_runs_the_native_step_with_the_layer_by_layer_bits(monkeypatch, kv_cache_dtype):
    native, layered = both_paths(monkeypatch, None, kv_cache_dtype=kv_cache_dtype)
    assert native == layered


@pytest.fixture(scope="module")
def family_ggufs(tmp_path_factory):
    out = tmp_path_factory.mktemp("native-step")
    files = {}
    for family, ftype in [("llama", "q4_0"), ("llama", "q8_0"), ("llama", "q5_0"), ("qwen2", "q4_1"),
                          ("phi3", "q4_0"), ("qwen3", "q4_0"), ("gemma3", "q8_0"), ("qwen3_moe", "q4_k"),
                          ("olmoe", "q8_0"), ("granitemoe", "q4_0"), ("mixtral", "q5_0"), ("lfm2", "q4_0"),
                          ("qwen3_5", "q8_0"), ("qwen3_5", "q4_k"), ("granitemoehybrid", "q8_0"),
                          ("smollm3", "q8_0"), ("smollm3", "q4_0")]:
        overrides = {"sliding_window": 24} if family in ("phi3", "mixtral") else {}
        hf = make_tiny_hf_model(out / family, family, **overrides)
        files[f"{family}-{ftype}"] = str(write_gguf_from_hf(hf, out / f"{family}-{ftype}.gguf", ftype=ftype))
    # a dense MLP among the MoE layers (mlp_only_layers, which a GGUF does not carry): the HF folder, quantized to
    # 4-bit codes at load
    files["qwen3_moe-dense-int4"] = str(make_tiny_hf_model(out / "qwen3_moe-dense", "qwen3_moe", num_hidden_layers=3,
                                                           mlp_only_layers=[1], decoder_sparse_step=1))
    return files


@pytest.mark.parametrize("name", ["llama-q4_0", "llama-q8_0", "llama-q5_0", "qwen2-q4_1", "phi3-q4_0", "qwen3-q4_0",
                                  "gemma3-q8_0", "qwen3_moe-q4_k", "olmoe-q8_0", "granitemoe-q4_0", "mixtral-q5_0",
                                  "qwen3_moe-dense-int4", "lfm2-q4_0", "qwen3_5-q8_0", "qwen3_5-q4_k",
                                  "granitemoehybrid-q8_0", "smollm3-q8_0", "smollm3-q4_0"])
def test_each_weight_format_and_family_it_takes_gives_the_same_bits(monkeypatch, family_ggufs, name):
    """4-, 5- and 8-bit codes; Qwen2's QKV bias; Phi-3's sliding window (the long prompts pass it); Qwen3's per-head
    Q/K norms; Gemma 3's scaled embedding, sandwich norms, tanh-GELU, head_dim 256 and local layers with their own
    RoPE base and a 16-token window; the mixtures of experts' routers (each family's rule) and stacked experts,
    Qwen3-MoE's dense layer among its MoE ones, OLMoE's Q/K norms over the whole projection, Granite's four scalings,
    Mixtral's sliding window; LFM2's short convolutions; Qwen3.5's Gated DeltaNet (fewer key than value heads: a
    GGUF's out_proj column order) and gated attention with partial RoPE; Granite 4.0 H's Mamba2 layers and attention
    without position embedding (NoPE); SmolLM3's NoPE layer among RoPE ones."""
    native, layered = both_paths(monkeypatch, family_ggufs[name], quantization="int4" if "int4" in name else None)
    assert native == layered


@pytest.mark.parametrize("name", ["lfm2-q4_0", "qwen3_5-q8_0", "granitemoehybrid-q8_0"])
def test_a_hybrids_recurrent_layers_under_speculation_and_from_checkpoints_give_the_same_bits(monkeypatch, family_ggufs,
                                                                                              name):
    """Drafts that a step accepts in part (a scripted proposer: test_hybrid_engine.py's) make runs of several rows
    over one state slot, snapshotted after each draft; the prompts' second pass restores prefix-cache checkpoints.
    Native and layer-by-layer: the same tokens and logprobs, and drafts were both accepted and rejected."""
    from test_hybrid_engine import KnownContinuation, rand_prompts

    prompts = rand_prompts()
    kwargs = dict(max_model_len=256, kv_cache_memory="64MiB", max_num_batched_tokens=32, enable_prefix_caching=True,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("KVFLOW_NATIVE_STEP", native)
        with LLM(family_ggufs[name], **kwargs) as llm:
            runner, sched = llm.engine.runner, llm.engine.scheduler
            assert (runner.native_step is not None) == (native == "1")
            plain = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
            sched.proposer = KnownContinuation({tuple(p): o for p, o in zip(prompts, plain)})
            hits = llm.engine.kv_cache_manager.prefix_cache_hits
            results.append((plain, answers(llm, prompts)))
            assert llm.engine.kv_cache_manager.prefix_cache_hits > hits
            assert 0 < sched.spec_num_accepted_tokens < sched.spec_num_draft_tokens
            llm.engine.kv_cache_manager.check()
    assert results[0] == results[1]
    assert [tokens for tokens, _ in results[0][1]] == results[0][0], "speculation changed the greedy output"


def test_two_threads_with_stalling_workers_give_one_threads_bits():
    """A step's kernels on kvflow's pool: a worker preempted mid-chunk (simulated: it sleeps 300 us before each
    commit) has its chunks taken back by the caller, and every bit stays the one-thread step's."""
    lib = build.library()
    with LLM(max_model_len=512, kv_cache_memory="64MiB", small_step_threads=1) as one:
        prompts = [one.tokenizer.encode(t) for t in TEXTS]
        want = answers(one, prompts)
    with LLM(max_model_len=512, kv_cache_memory="64MiB") as llm:
        assert llm.engine.runner.native_step is not None
        assert llm.engine.runner.plan.step_threads(1)[1] == llm.engine.runner.threads
        try:
            lib.kvflow_pool_set_stall(300)
            assert answers(llm, prompts) == want
        finally:
            lib.kvflow_pool_set_stall(0)


@pytest.mark.parametrize("case", ["env", "lora", "float-weights", "clip-qkv"])
def test_where_the_native_step_does_not_build_the_layer_by_layer_path_serves(tmp_path, monkeypatch, caplog, case):
    """The fallback: turned off, or a model it does not compute (LoRA terms, float weights that are not kvflow's
    kernels', OLMoE's QKV clipping): no native step, and the engine answers as before."""
    kwargs = dict(max_model_len=256, kv_cache_memory="32MiB")
    model = None
    if case == "env":
        monkeypatch.setenv("KVFLOW_NATIVE_STEP", "0")
    elif case == "lora":
        kwargs.update(enable_lora=True, max_lora_rank=8)
    elif case == "float-weights":
        model = str(make_tiny_hf_model(tmp_path / "llama", "llama"))
    else:
        hf = make_tiny_hf_model(tmp_path / "olmoe", "olmoe", clip_qkv=8.0)
        model = str(write_gguf_from_hf(hf, tmp_path / "olmoe.gguf", ftype="q8_0"))
    with caplog.at_level("INFO", logger="kvflow"), LLM(model, **kwargs) as llm:
        assert llm.engine.runner.native_step is None
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    if case in ("env", "lora", "clip-qkv"):      # kvflow's kernels serve these: the boot log says why not
        assert "the native step does not run here" in caplog.text
