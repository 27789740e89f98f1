"""Granite 4.0 H (GraniteMoeHybridForCausalLM, dense) against transformers 5.24 in float32, on a random-weight model
with the released models' layout, small (tiny_models.HYBRID_SHAPES): Mamba2 layers with two B/C groups, NoPE
attention at layers 2 and 5, Granite's multipliers, the dense shared MLP.

The Mamba2 layer alone: its output and both states (convolution window, SSM matrix) against transformers' layer
with its cache, over a prompt then decode tokens; a prompt split in chunks and several requests in one step give the
same as each alone. The config: the released checkpoints' layer spelling and transformers 5's, its infinite
time_step_limit, the GGUF metadata. End to end through kvflow.LLM: greedy tokens equal to transformers', prompts
chunked or not, alone or batched (bit for bit), again from prefix-cache checkpoints; the GGUF twin, float and Q8_0."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from kvflow import LLM, SamplingParams
from kvflow.kernels.recurrent import StateBatch
from kvflow.layers.attention_metadata import AttentionMetadata
from kvflow.models.granite_hybrid import GraniteHybridForCausalLM
from kvflow.models.loader import iter_weights
from kvflow.models.model_config import MAMBA2, ModelConfig
from kvflow.models.model_files import resolve_model_files
from tiny_models import make_tiny_hf_model, write_gguf_from_hf
from transformers_greedy import assert_greedy_matches

HIDDEN = 64
MAMBA_LAYERS = (0, 1, 3, 4)
NONE = torch.tensor([], dtype=torch.long)


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("granite_h"), family="granitemoehybrid", seed=3)


@pytest.fixture(scope="module")
def hf_model(granite_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(granite_dir, dtype=torch.float32).eval()


def kvflow_model(path) -> GraniteHybridForCausalLM:
    files = resolve_model_files(path)
    model = GraniteHybridForCausalLM(files.config, 256)
    model.load_weights(iter_weights(files))
    return model.eval()


@pytest.fixture(scope="module")
def model(granite_dir):
    return kvflow_model(granite_dir)


def bind_states(mixer, slots: int = 4) -> dict[str, torch.Tensor]:
    states = {name: torch.zeros(slots, *shape, dtype=dtype)
              for name, (shape, dtype) in mixer.state_shapes(torch.float32).items()}
    mixer.bind_state(states)
    return states


def step_meta(lengths: list[int], slots: list[int]) -> AttentionMetadata:
    """A step of runs: `lengths[i]` consecutive rows continuing slot `slots[i]` (no attention in these tests)."""
    starts = torch.tensor([0, *lengths]).cumsum(0)
    return AttentionMetadata(slot_mapping=NONE, num_decode_tokens=0,
                             state=StateBatch(starts, torch.tensor(slots), NONE, NONE))


def test_config_reads_granite_4_h(granite_dir):
    cfg = resolve_model_files(granite_dir).config
    r = cfg.recurrent
    assert r.kind == MAMBA2 and r.layers == MAMBA_LAYERS and r.conv_kernel == 4 and r.conv_bias
    assert (r.num_heads, r.head_dim, r.state_size, r.num_groups) == (8, 16, 16, 2)
    assert r.time_step_limit == (0.0, float("inf"))       # written by transformers as {"__float__": "Infinity"}
    assert cfg.nope_layers == tuple(range(6)) and cfg.intermediate_size == 128      # shared_intermediate_size
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling) == (
        12.0, 0.22, 0.0625, 6.0)
    saved = json.loads((granite_dir / "config.json").read_text())
    assert saved["layer_types"][:3] == ["mamba", "mamba", "attention"]       # the released checkpoints' spelling
    # transformers 5's spelling and the older key read the same
    for key, names in (("layer_types", ("linear_attention", "full_attention")),
                       ("layers_block_type", ("mamba", "attention"))):
        other = {k: v for k, v in saved.items() if k != "layer_types"}
        other[key] = [names[0] if t == "mamba" else names[1] for t in saved["layer_types"]]
        assert ModelConfig.from_hf_dict(other).recurrent.layers == MAMBA_LAYERS


def test_moe_variants_read_experts_beside_the_shared_mlp(granite_dir):
    cfg = json.loads((granite_dir / "config.json").read_text())
    moe = ModelConfig.from_hf_dict({**cfg, "num_local_experts": 4, "num_experts_per_tok": 2})
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.intermediate_size) == (4, 2, 32,
                                                                                                          128)
    assert all(moe.is_moe_layer(i) for i in range(6)) and moe.norm_topk_prob
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**cfg, "num_local_experts": 4, "num_experts_per_tok": 5})


@pytest.mark.slow
def test_moe_variant_matches_transformers(tmp_path, monkeypatch):
    """Granite 4.0 H Tiny's layout, small: experts (GraniteMoE's router: the top k logits, then their softmax) beside
    the shared MLP in every layer, their sums added; float32 against transformers, batched and chunked, and on
    kvflow's kernels (int4 codes) the native step's bits equal the layer-by-layer path's."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(tmp_path / "granite-moe", "granitemoehybrid", num_local_experts=4,
                              num_experts_per_tok=2, intermediate_size=32, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[5, 6, 7], list(range(100, 190)), [42]]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB", max_num_batched_tokens=32)
    assert all(layer.block_sparse_moe is not None for layer in llm.engine.runner.model.layers)
    for p, out in zip(prompts, llm.generate(prompts, greedy)):
        assert_greedy_matches(hf, p, out.outputs[0].token_ids, "granite 4.0 h moe, ", MAX_TOKENS)
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("KVFLOW_NATIVE_STEP", native)
        with LLM(str(path), quantization="int4", max_model_len=256, kv_cache_memory="32MiB",
                 max_num_batched_tokens=32) as quantized:
            assert (quantized.engine.runner.native_step is not None) == (native == "1")
            results.append([o.outputs[0].token_ids for o in quantized.generate(prompts, greedy)])
    assert results[0] == results[1]


def test_model_refuses_what_it_does_not_do(model, granite_dir):
    from kvflow.distributed.parallel_state import TensorParallel
    from kvflow.layers.native_layers import NotNative

    assert [i for i, layer in enumerate(model.layers) if layer.mamba is not None] == list(MAMBA_LAYERS)
    assert len(model.attention_layers) == 2 and len(model.state_layers) == 4
    assert model.rotary is None and all(layer.self_attn.rotary is None for layer in model.layers
                                        if layer.self_attn is not None)
    assert model.compiled_decode is False
    with pytest.raises(NotNative, match="state slots are not allocated"):     # the runner binds them first
        model.native_decoder()
    with pytest.raises(ValueError, match="mamba.in_proj is a projection of Granite 4.0 H's Mamba2 mixer"):
        model.enable_lora(1, 8, targets=("q_proj", "in_proj"))        # LoRA: not on the Mamba2 layers
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        GraniteHybridForCausalLM(model.config, 256, TensorParallel(rank=0, size=2))


def test_state_shapes(model):
    mixer = model.state_layers[0]
    assert mixer.state_shapes(torch.bfloat16) == {"conv": ((3, 128 + 2 * 2 * 16), torch.bfloat16),
                                                   "ssm": ((8, 16, 16), torch.float32)}


@pytest.mark.parametrize("layer", [0, 4])
def test_mamba2_layer_matches_transformers_prompt_then_decodes(model, hf_model, layer):
    """transformers' layer with its cache: the chunked scan over a 12-token prompt, then its single-token update for
    8 decodes; kvflow's layer over the same rows in slot 2, the states compared after each step."""
    from transformers import DynamicCache

    mixer, hf_mixer = model.layers[layer].mamba, hf_model.model.layers[layer].mamba
    states = bind_states(mixer)
    x = torch.randn(1, 20, HIDDEN, generator=torch.Generator().manual_seed(layer))
    cache = DynamicCache(config=hf_model.config)
    with torch.no_grad():
        for start, end in [(0, 12), *((t, t + 1) for t in range(12, 20))]:
            want = hf_mixer(x[:, start:end], cache=cache)[0]
            got = mixer(x[0, start:end], step_meta([end - start], [2]))
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
            hf_conv = cache.layers[layer].conv_states[0][0]             # [channels, K]: the last K inputs
            hf_ssm = cache.layers[layer].recurrent_states[0][0]         # [heads, head_dim, N]
            torch.testing.assert_close(states["conv"][2], hf_conv[:, 1:].T, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(states["ssm"][2], hf_ssm, atol=2e-5, rtol=1e-4)
    # the other slots untouched
    assert states["conv"][[0, 1, 3]].abs().sum() == 0 and states["ssm"][[0, 1, 3]].abs().sum() == 0


def test_mamba2_state_carries_the_past(model):
    """The same last 4 rows after two different pasts give different outputs: the state is read (a layer that
    ignored it would pass the tests above on short inputs only by chance)."""
    mixer = model.state_layers[0]
    bind_states(mixer)
    g = torch.Generator().manual_seed(5)
    past_a, past_b, tail = torch.randn(16, HIDDEN, generator=g), torch.randn(16, HIDDEN, generator=g), \
        torch.randn(4, HIDDEN, generator=g)
    with torch.no_grad():
        mixer(past_a, step_meta([16], [0]))
        mixer(past_b, step_meta([16], [1]))
        a = mixer(tail, step_meta([4], [0]))
        b = mixer(tail, step_meta([4], [1]))
    assert (a - b).abs().max() > 1e-3


def test_mamba2_chunks_and_neighbours_do_not_change_a_request(model):
    """A 24-row prompt in one run, in chunks of 7 over four steps, and beside two other requests in one step (runs
    of 24, 1 and 9 rows): the recurrences' rows equal, and both states."""
    mixer = model.state_layers[1]
    states = bind_states(mixer, slots=5)
    g = torch.Generator().manual_seed(6)
    prompt, other, third = (torch.randn(n, HIDDEN, generator=g) for n in (24, 1, 9))
    with torch.no_grad():
        alone = mixer(prompt, step_meta([24], [0]))
        alone_states = {n: s[0].clone() for n, s in states.items()}
        chunks = torch.cat([mixer(prompt[a:a + 7], step_meta([len(prompt[a:a + 7])], [1])) for a in range(0, 24, 7)])
        batched = mixer(torch.cat([other, prompt, third]), step_meta([1, 24, 9], [3, 2, 4]))[1:25]
    torch.testing.assert_close(chunks, alone, atol=1e-6, rtol=1e-6)
    assert torch.equal(batched, alone)
    for name in states:
        torch.testing.assert_close(states[name][1], alone_states[name], atol=1e-6, rtol=1e-6)
        assert torch.equal(states[name][2], alone_states[name])


def test_whole_model_forward_matches_transformers(model, hf_model):
    """Every layer, Mamba2 and NoPE attention, with Granite's multipliers: one prompt's logits (no cache), through
    kvflow's model with its states and a plain single-prefill attention step."""
    from kvflow.layers.attention_metadata import PrefillBatch

    n = 17
    ids = torch.randint(10, 40000, (1, n), generator=torch.Generator().manual_seed(8))
    for mixer in model.state_layers:
        bind_states(mixer)
    for attn in model.attention_layers:
        attn.k_cache = torch.zeros(2, 16, attn.num_kv_heads, attn.head_dim)
        attn.v_cache = torch.zeros(2, 16, attn.num_kv_heads, attn.head_dim)
    rows = torch.arange(n)
    # one chunk without a past: attention over its own keys, causal (PagedAttention's maskless prefill)
    prefill = PrefillBatch(1, n, n, rows, rows, rows, mask=None)
    meta = AttentionMetadata(slot_mapping=rows, num_decode_tokens=0, prefill=prefill,
                             state=StateBatch(torch.tensor([0, n]), torch.tensor([0]), NONE, NONE))
    with torch.no_grad():
        want = hf_model(input_ids=ids, use_cache=False).logits[0]
        got = model.compute_logits(model(ids[0], rows, meta))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_gguf_twin_loads_the_same_weights(granite_dir, model, tmp_path):
    """llama.cpp's granitehybrid layout (per-layer head_count_kv with 0 for Mamba layers, ssm.* keys, ssm_a =
    -exp(A_log), (heads, 1) A and D, the (groups, d_inner / groups) norm, the split shared MLP, permuted Q/K): the
    same config and weights as the folder's, A_log up to the log(exp()) round trip."""
    gguf_path = write_gguf_from_hf(granite_dir, tmp_path / "granite.gguf", "f32")
    files = resolve_model_files(gguf_path)
    cfg = files.config
    assert cfg.recurrent == model.config.recurrent and cfg.nope_layers == model.config.nope_layers
    assert (cfg.num_key_value_heads, cfg.intermediate_size, cfg.head_dim) == (2, 128, 16)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling) == (
        12.0, 0.22, 0.0625, 6.0)
    twin = GraniteHybridForCausalLM(cfg, 256)
    twin.load_weights(iter_weights(files))
    mine = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        if name.endswith("A_log"):
            torch.testing.assert_close(p, mine[name], atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(p, mine[name]), name


# ---- end to end through kvflow.LLM ------------------------------------------------------------------------------

MAX_TOKENS = 16


def prompts() -> list[list[int]]:
    """Short ones, one of 64 tokens (four chunks at max_num_batched_tokens=16), two sharing a 40-token prefix (a
    prefix-cache checkpoint at their junction), one token."""
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(10, 40000, (n,), generator=g).tolist()     # noqa: E731
    shared = rand(40)
    return [rand(5), rand(64), shared + rand(4), shared + rand(9), rand(20), [42]]


def greedy(llm, batch: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(batch, params)]


def serve(path, **engine):
    settings = dict(dtype="float32", max_model_len=256, kv_cache_memory="32MiB")
    return LLM(str(path), **{**settings, **engine})


def check_batch_and_cache(llm, batch: list[list[int]]) -> list[list[int]]:
    """The batch's greedy tokens; then again (prefix-cache hits restore checkpointed states) and each prompt alone:
    bit for bit the same tokens."""
    first = greedy(llm, batch)
    hits = llm.engine.kv_cache_manager.prefix_cache_hits
    assert greedy(llm, batch) == first, "prefix-cache hits (checkpointed states) changed the output"
    assert llm.engine.kv_cache_manager.prefix_cache_hits > hits
    llm.engine.kv_cache_manager.check()
    alone = [greedy(llm, [p])[0] for p in batch]
    assert alone == first, "a request's tokens depend on what shares its step"
    return first


@pytest.mark.slow
@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 16}], ids=["default", "chunked"])
def test_llm_matches_transformers(granite_dir, hf_model, engine):
    llm = serve(granite_dir, **engine)
    assert len(llm.engine.runner.state_layers) == 4 and llm.engine.runner.state_slots.live >= 1
    batch = prompts()
    got = check_batch_and_cache(llm, batch)
    for p, tokens in zip(batch, got):
        assert_greedy_matches(hf_model, p, tokens, f"granite 4.0 h ({'chunked' if engine else 'default'}), ",
                              MAX_TOKENS)


def rounded_hf_twin(gguf_path, hf_dir, out_dir):
    """An HF folder holding a GGUF's own values (dequantized), in transformers' names and shapes: what transformers
    would compute from the file."""
    from safetensors.torch import save_file

    model = kvflow_model(gguf_path)
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    tensors = {}
    for name, p in model.named_parameters():
        name = "lm_head.weight" if name == "lm_head.weight" else f"model.{name}"
        p = p.detach()
        if ".qkv_proj." in name:
            for piece, part in zip(("q_proj", "k_proj", "v_proj"), p.split([q, kv, kv])):
                tensors[name.replace("qkv_proj", piece)] = part
            continue
        name = name.replace("mlp.gate_up_proj", "shared_mlp.input_linear").replace("mlp.down_proj",
                                                                                    "shared_mlp.output_linear")
        if name.endswith("conv1d.weight"):
            p = p.unsqueeze(1)
        tensors[name] = p
    out_dir.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            (out_dir / f.name).write_bytes(f.read_bytes())
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out_dir / "model.safetensors"))
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["f32", "q8_0"])
def test_gguf_twin_matches_transformers(granite_dir, hf_model, tmp_path, ftype):
    """The GGUF twin at dtype float32 (the file's values as floats): f32 gives transformers' tokens on the folder;
    Q8_0 transformers' tokens on the folder rounded as the file holds it."""
    from transformers import AutoModelForCausalLM

    gguf_path = write_gguf_from_hf(granite_dir, tmp_path / f"granite-{ftype}.gguf", ftype)
    reference = hf_model
    if ftype != "f32":
        twin = rounded_hf_twin(gguf_path, granite_dir, tmp_path / "rounded")
        reference = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    batch = prompts()
    got = greedy(serve(gguf_path, max_num_batched_tokens=16), batch)
    for p, tokens in zip(batch, got):
        assert_greedy_matches(reference, p, tokens, f"granite 4.0 h GGUF {ftype}, ", MAX_TOKENS)


@pytest.mark.slow
def test_quantized_gguf_serves_its_codes_batch_invariant(granite_dir, tmp_path):
    """A Q8_0 twin at the default dtype keeps its codes: the Mamba2 projections too are quantized modules (the conv
    taps, A, D and norms stay float, as the file holds them); its first tokens follow the float run's, and a request's
    tokens are the same alone and batched."""
    gguf_path = write_gguf_from_hf(granite_dir, tmp_path / "granite-q8_0.gguf", "q8_0")
    llm = LLM(str(gguf_path), max_model_len=256, kv_cache_memory="32MiB")
    assert llm.engine.runner.quantization == "gguf"
    mixer = llm.engine.runner.model.state_layers[0]
    assert type(mixer.in_proj) is not nn.Linear and type(mixer.out_proj) is not nn.Linear
    batch = prompts()
    together = check_batch_and_cache(llm, batch)
    floats = greedy(serve(gguf_path), batch)
    assert sum(a[:4] == b[:4] for a, b in zip(together, floats)) >= len(batch) - 1
