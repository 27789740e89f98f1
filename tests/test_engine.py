"""End-to-end engine tests: kvflow's greedy tokens against Hugging Face transformers, token for token, and
the engine's invariants (batching, chunking, preemption, seeds) on real models, in float32."""
from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from tiny_models import make_tiny_hf_model, write_gguf_from_hf
from transformers_greedy import assert_greedy_matches

SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Explain HNSW in 3 sentences.",
    "List three colors:",
    "Translate to French: I like apples.",
    "Q: What is 17 * 3?\nA:",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(autouse=True)
def kv_cache_integrity(request):
    """After every engine test, every LLM it used must be idle with all KV blocks free and unreferenced."""
    yield
    for name in ("smol_llm", "tiny_llama_llm"):
        if name in request.fixturenames:
            request.getfixturevalue(name).engine.kv_cache_manager.check()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"), family="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, kv_cache_memory="64MiB")


# ---- correctness against transformers ------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smol_llm, hf_smol):
    outs = smol_llm.generate(SMOL_PROMPTS, GREEDY)
    eos = smol_llm.tokenizer.eos_token_ids
    for o in outs:
        ours = o.outputs[0].token_ids
        # 32 tokens, or fewer ending at the end-of-sequence token where transformers' generation would stop too
        assert len(ours) == 32 or (ours and ours[-1] in eos and not set(ours[:-1]) & eos), ours
        assert_greedy_matches(hf_smol, o.prompt_token_ids, ours, f"{o.prompt!r}: ")
    assert sum(len(o.outputs[0].token_ids) for o in outs) > 8 * 8   # not all stopped at once


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_random_models_match_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM
    path = make_tiny_hf_model(tmp_path, family=family, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB")
    prompts = [[5, 17, 300, 4000, 12], list(range(100, 160)), [42]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert len(o.outputs[0].token_ids) == 24
        assert_greedy_matches(hf, p, o.outputs[0].token_ids)
    llm.engine.kv_cache_manager.check()


@pytest.mark.slow
def test_safetensors_and_gguf_of_the_same_weights_give_the_same_logits(tiny_llama_dir, tiny_llama_llm, tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf_from_hf(tiny_llama_dir, gguf_path)
    from_gguf = LLM(str(gguf_path), dtype="float32", max_model_len=256, kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    prompt = [[7, 8, 9, 1000, 2000, 3000]]
    a = tiny_llama_llm.generate(prompt, params)[0].outputs[0]
    b = from_gguf.generate(prompt, params)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for la, lb in zip(a.logprobs, b.logprobs):
        assert la.keys() == lb.keys()
        for t in la:
            assert la[t] == pytest.approx(lb[t], abs=1e-5)
    from_gguf.engine.kv_cache_manager.check()


# ---- engine invariants -----------------------------------------------------------------------------

def mixed_prompts(tokenizer, k=16):
    base = [p for p in SMOL_PROMPTS] + ["Why is the sky blue? " * r for r in range(1, 9)]
    return [tokenizer.encode(t) for t in base[:k]]


@pytest.mark.slow
def test_batch_invariance_alone_and_in_a_batch_of_16(smol_llm):
    prompts = mixed_prompts(smol_llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    batched = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    alone = [smol_llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone
    assert len({len(p) for p in prompts}) > 8


@pytest.mark.slow
def test_chunked_prefill_gives_the_same_outputs(smol_llm):
    prompts = mixed_prompts(smol_llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    whole = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    chunked_llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory="128MiB",
                       max_num_batched_tokens=16, enable_prefix_caching=False)
    chunked = [o.outputs[0].token_ids for o in chunked_llm.generate(prompts, params)]
    assert max(len(p) for p in prompts) > 16
    assert chunked == whole
    chunked_llm.engine.kv_cache_manager.check()


@pytest.mark.slow
def test_preemption_with_a_tiny_kv_cache_loses_nothing(tiny_llama_dir, tiny_llama_llm):
    prompts = [[(i * 37 + j) % 40000 + 10 for j in range(20 + i)] for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ample = [o.outputs[0].token_ids for o in tiny_llama_llm.generate(prompts, params)]
    # 2 layers x 2 KV heads x 16 dims x fp32 x K,V = 512 B per token: 12 blocks of 16 tokens
    small = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, kv_cache_memory=12 * 16 * 512,
                enable_prefix_caching=False)
    assert small.engine.runner.num_blocks == 12
    tight = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.engine.scheduler.num_preemptions > 0
    assert tight == ample
    small.engine.kv_cache_manager.check()


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llama_llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = [11, 22, 33, 44]
    alone = tiny_llama_llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=7, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    outs = tiny_llama_llm.generate([[1, 2, 3], prompt, [9] * 30, [4, 5]], [others[0], seeded, others[1], others[2]])
    assert outs[1].outputs[0].token_ids == alone
    different_seed = tiny_llama_llm.generate([prompt], SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    assert different_seed != alone


@pytest.mark.slow
def test_n_samples_stop_strings_and_logprobs(smol_llm):
    out = smol_llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=10))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(c.token_ids for c in out.outputs)
    stopped = smol_llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=30, stop=["6"]))[0]
    c = stopped.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "6" and "6" not in c.text and "5" in c.text
    lp = smol_llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2))[0].outputs[0]
    assert len(lp.logprobs) == 3
    for tok, entry in zip(lp.token_ids, lp.logprobs):
        assert tok in entry and max(entry.values()) == entry[tok] and len(entry) == 2


def test_penalties_min_tokens_and_stop_token_ids(tiny_llama_llm):
    prompt = [[100, 200, 300]]
    plain = tiny_llama_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    rep = tiny_llama_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                         repetition_penalty=2.0, frequency_penalty=1.5))
    plain_ids, rep_ids = plain[0].outputs[0].token_ids, rep[0].outputs[0].token_ids
    assert len(set(rep_ids)) > len(set(plain_ids))
    first = plain_ids[0]
    stopped = tiny_llama_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                             stop_token_ids=[first]))[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason == first
    held = tiny_llama_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=5,
                                                          stop_token_ids=[first]))[0].outputs[0]
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:5]


# ---- bad input ---------------------------------------------------------------------------------------

def test_too_long_prompt_is_a_value_error_naming_both_numbers(tiny_llama_llm):
    with pytest.raises(ValueError, match=r"250.*max_tokens \(10\).*256"):
        tiny_llama_llm.generate([[5] * 250], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="300 tokens.*256"):
        tiny_llama_llm.generate([[5] * 300], SamplingParams(max_tokens=10))
    ok = tiny_llama_llm.generate([[5] * 10], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(ok[0].outputs[0].token_ids) == 3


def test_bad_sampling_params_name_the_field():
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                          ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"logprobs": 50}, "logprobs")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_missing_model_and_unsupported_architecture(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(tmp_path / "gpt2"))
