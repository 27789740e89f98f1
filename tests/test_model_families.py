"""Issue 30's model families on random-weight models with their real configs (small sizes), token for token
against transformers in float32: Gemma 3 (sliding window, in kvflow's attention kernel and in the pure-PyTorch
paths, with chunked prefill and prefix caching), Phi-3 (fused qkv / gate_up, sliding window) and Phi-4-mini's shape
(partial rotary, LongRoPE), Llama 3.2 (llama3 RoPE scaling), Qwen3 (QK-norm); and the architecture table."""
from __future__ import annotations

import json
import os

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels import build
from kvflow.models.model_config import ARCHITECTURES, ModelConfig
from kvflow.models.model_files import resolve_model_files
from tiny_models import make_tiny_hf_model
from transformers_greedy import assert_greedy_matches

MAX_TOKENS = 20


def prompts_for(window: int) -> list[list[int]]:
    """Short ones, ones longer than the window (several blocks), and two sharing a long prefix (a prefix-cache hit
    that starts past the window)."""
    g = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(10, 40000, (n,), generator=g).tolist()     # noqa: E731
    shared = rand(3 * window + 5)
    return [rand(5), rand(window + 3), rand(4 * window + 1), shared + rand(4), shared + rand(9), [42]]


def run(path, prompts, **engine) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB", **engine)
    # which attention ran: kvflow's kernel where it can, else (KVFLOW_NATIVE_KERNELS=0) the pure-PyTorch paths
    assert llm.engine.runner.native_attention == (build.usable()
                                                  and os.environ.get("KVFLOW_NATIVE_KERNELS") != "0")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    hits = llm.engine.kv_cache_manager.prefix_cache_hits
    # again: every prompt's full blocks are prefix-cache hits now
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.kv_cache_manager.prefix_cache_hits - hits >= 16 * 8
    llm.engine.kv_cache_manager.check()
    assert again == first, "prefix-cache hits changed the output"
    return first


def check_family(tmp_path, monkeypatch, family: str, window: int | None = None, **overrides):
    """Greedy tokens equal to transformers' through kvflow's attention kernel and, for a model with a window, the
    pure-PyTorch paths too (without one, those paths are the families' old ones, tested elsewhere)."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(tmp_path, family=family, seed=2, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = prompts_for(window or 16)
    # chunked prefill: the budget cuts the long prompts into chunks that start past the window
    paths = {"default": {}, "chunked": {"max_num_batched_tokens": 13}}
    for name, engine in paths.items():
        got = run(path, prompts, **engine)
        for p, a in zip(prompts, got):
            assert_greedy_matches(hf, p, a, f"{family} ({name}), ", MAX_TOKENS)
    if window and build.usable():     # the runs above used kvflow's kernel: now the pure-PyTorch paths
        monkeypatch.setenv("KVFLOW_NATIVE_KERNELS", "0")
        for name, engine in paths.items():
            got = run(path, prompts, **engine)
            for p, a in zip(prompts, got):
                assert_greedy_matches(hf, p, a, f"{family} (SDPA, {name}), ", MAX_TOKENS)
    return path


@pytest.mark.slow
def test_gemma3_random_model_matches_transformers_with_its_sliding_window(tmp_path, monkeypatch):
    path = check_family(tmp_path, monkeypatch, "gemma3", window=16)
    cfg = resolve_model_files(path).config
    assert cfg.sliding_window == 16 and cfg.layer_types.count("sliding_attention") == 5
    assert cfg.rope_local_theta == 10_000.0 and cfg.rope_theta == 1_000_000.0 and cfg.head_dim == 256


@pytest.mark.slow
def test_the_window_changes_the_output(tmp_path):
    """The same weights with the window opened past the prompts: a different continuation on the long prompts, so
    the test above checks the window and not attention that ignores it."""
    path = make_tiny_hf_model(tmp_path / "w", family="gemma3", seed=2)
    prompts = prompts_for(16)
    narrow = run(path, prompts)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = 4096
    (path / "config.json").write_text(json.dumps(cfg))
    wide = run(path, prompts)
    # the 5-token prompt's first 12 tokens are computed within the window (positions < 16); the long prompt's not
    assert narrow[0][:12] == wide[0][:12] and narrow[0] != wide[0] and narrow[2] != wide[2]


@pytest.mark.slow
def test_phi3_fused_checkpoint_with_a_sliding_window_matches_transformers(tmp_path, monkeypatch):
    # Phi-3-mini-4k's shape: fused qkv_proj and gate_up_proj, a window on every layer (2047 there)
    check_family(tmp_path, monkeypatch, "phi3", window=16, sliding_window=16, num_key_value_heads=4)


@pytest.mark.slow
def test_phi4_mini_partial_rotary_and_longrope_match_transformers(tmp_path, monkeypatch):
    # Phi-4-mini's shape: 3/4 of each head rotates, LongRoPE (short factors within the original context), tied
    rotary_half = int(16 * 0.75) // 2
    path = check_family(tmp_path, monkeypatch, "phi3", partial_rotary_factor=0.75, tie_word_embeddings=True,
                        max_position_embeddings=131072, original_max_position_embeddings=4096,
                        rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 4096,
                                      "short_factor": [1.0 + 0.3 * i for i in range(rotary_half)],
                                      "long_factor": [4.0 + i for i in range(rotary_half)]})
    cfg = resolve_model_files(path).config
    assert cfg.rotary_dim == 12 and cfg.max_position_embeddings == 4096     # capped: the short factors only


@pytest.mark.slow
def test_llama32_rope_scaling_matches_transformers(tmp_path, monkeypatch):
    # Llama 3.2 1B's rope: theta 500k, llama3 scaling factor 32 from 8192, tied embeddings
    check_family(tmp_path, monkeypatch, "llama", rope_theta=500_000.0, tie_word_embeddings=True,
                 rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


@pytest.mark.slow
def test_qwen3_qk_norm_matches_transformers(tmp_path, monkeypatch):
    # Qwen3-0.6B's shape: head_dim larger than hidden / heads, QK-norm, theta 1M, tied embeddings
    check_family(tmp_path, monkeypatch, "qwen3", head_dim=32, rope_theta=1_000_000.0, tie_word_embeddings=True)


# ---- the architecture table ------------------------------------------------------------------------------------

def test_architecture_table_and_its_errors():
    names = {a.name for a in ARCHITECTURES}
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"} <= names
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict({**base, "architectures": ["GPT2LMHeadModel"]})
    assert "'GPT2LMHeadModel'" in str(e.value) and all(n in str(e.value) for n in names)
    with pytest.raises(ValueError, match="vision tower"):
        ModelConfig.from_hf_dict({**base, "architectures": ["Gemma3ForConditionalGeneration"]})
    # no `architectures`: the model_type names the row
    assert ModelConfig.from_hf_dict({**base, "model_type": "gemma3_text"}).family == "gemma3"
    with pytest.raises(ValueError, match="'gpt2'"):
        ModelConfig.from_hf_dict({**base, "model_type": "gpt2"})
    suffix = {"generate": "ForCausalLM", "embed": "Model", "score": "ForSequenceClassification"}
    for arch in ARCHITECTURES:      # every row's model class imports, and is one for the row's task
        assert arch.load_class().__name__.endswith(suffix[arch.task])


# ---- the same models as GGUF files (llama.cpp's names and conventions) --------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family,overrides", [
    ("gemma3", {}),                                                        # norms stored as 1 + w, renamed norms
    ("phi3", {"sliding_window": 16, "partial_rotary_factor": 0.75}),       # attn_qkv, fused ffn_up, rotary count
    ("phi3", {"partial_rotary_factor": 0.75, "max_position_embeddings": 131072,      # LongRoPE: rope_factors_*
              "original_max_position_embeddings": 4096,
              "rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                               "short_factor": [1.0 + 0.3 * i for i in range(6)],
                               "long_factor": [4.0 + i for i in range(6)]}}),
])
def test_gguf_twin_gives_the_safetensors_tokens(tmp_path, family, overrides):
    from transformers import AutoModelForCausalLM

    from tiny_models import write_gguf_from_hf

    path = make_tiny_hf_model(tmp_path / "hf", family=family, seed=3, **overrides)
    gguf_path = write_gguf_from_hf(path, tmp_path / f"{family}.gguf")
    a, b = resolve_model_files(path).config, resolve_model_files(gguf_path).config
    fields = ("family", "sliding_window", "layer_types", "rotary_dim", "rope_theta", "rope_local_theta", "head_dim",
              "tie_word_embeddings", "query_pre_attn_scalar", "hidden_act", "qk_norm")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = prompts_for(16)[1:4]
    llm = LLM(str(gguf_path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    for p, a in zip(prompts, got):
        assert_greedy_matches(hf, p, a, length=MAX_TOKENS)


@pytest.mark.slow
def test_gemma3_k_quant_gguf_default_config_is_batch_invariant(tmp_path):
    """A random Gemma 3 whose matrices are 256 wide, as llama-quantize's Q4_K_M writes it (Q4_K, Q6_K for the
    embedding and some attn_v / ffn_down): served from the file's codes by default, each prompt alone as in a batch."""
    from kvflow.layers.int4 import Int4Linear
    from tiny_models import write_gguf_from_hf

    path = make_tiny_hf_model(tmp_path / "hf", family="gemma3", seed=4, hidden_size=256, intermediate_size=512)
    gguf_path = write_gguf_from_hf(path, tmp_path / "g-q4_k_m.gguf", ftype="q4_k_m")
    llm = LLM(str(gguf_path), max_model_len=256, kv_cache_memory="32MiB")
    assert llm.engine.runner.quantization == "gguf"
    assert any(isinstance(m, Int4Linear) for m in llm.engine.runner.model.modules())
    prompts = prompts_for(16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    if build.usable():
        assert together == [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    llm.engine.kv_cache_manager.check()
