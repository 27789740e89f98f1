"""LFM2 (models/lfm2.py) against transformers 5.24 in float32: its short convolution layer and state against
transformers' Lfm2ShortConv and its cache (prompt, chunked continuation, decode, several requests in one step,
snapshots); the whole model through kvflow.LLM, greedy token for token (chunked prompts, batched and alone, prefix-cache
hits restoring the convolution states), from the HF folder and from its GGUF twins as transformers loads the same
files; batch and chunking invariance on the file's Q8_0 codes; the config and GGUF metadata it reads; the refusals."""
from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels import build
from kvflow.kernels.recurrent import StateBatch
from kvflow.layers.attention_metadata import AttentionMetadata
from kvflow.models.lfm2 import ShortConv
from kvflow.models.model_config import SHORT_CONV, ModelConfig

HIDDEN, L_CACHE = 64, 3
MAX_TOKENS = 20
BATCHED_TOKENS = 64         # max_num_batched_tokens: the 150-token prompt takes three chunks


def _hf_config(**overrides):
    from transformers import Lfm2Config

    kwargs = dict(vocab_size=128, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
                  conv_L_cache=L_CACHE)
    kwargs.update(overrides)
    config = Lfm2Config(**kwargs)
    config.architectures = ["Lfm2ForCausalLM"]
    return config


def _meta(runs: list[tuple[int, int]], snapshots: list[tuple[int, int]] = ()) -> AttentionMetadata:
    """A step's metadata with only the state runs set: `runs` (rows, slot) in flat-batch order; `snapshots`
    (row, slot)."""
    starts = [0]
    for rows, _ in runs:
        starts.append(starts[-1] + rows)
    rows, slots = zip(*snapshots) if snapshots else ((), ())
    state = StateBatch(torch.tensor(starts), torch.tensor([s for _, s in runs]), torch.tensor(rows, dtype=torch.long),
                       torch.tensor(slots, dtype=torch.long))
    return AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=0, state=state)


class _Reference:
    """transformers' Lfm2ShortConv with one cache per request (batch 1 each)."""

    def __init__(self, config, seed: int = 0):
        from transformers.cache_utils import DynamicCache
        from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

        self.config, self.DynamicCache = config, DynamicCache
        torch.manual_seed(seed)
        self.module = Lfm2ShortConv(config, layer_idx=0).eval()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.module.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        self.caches: dict[str, object] = {}

    @torch.no_grad()
    def __call__(self, request: str, x: torch.Tensor) -> torch.Tensor:
        cache = self.caches.setdefault(request, self.DynamicCache(config=self.config))
        return self.module(x[None], cache=cache)[0]

    def state(self, request: str) -> torch.Tensor:
        """The cache's window as kvflow keeps it: its last L - 1 inputs, [L - 1, hidden]."""
        conv = self.caches[request].get_conv_state(0)           # [1, hidden, L]
        return conv[0, :, -(L_CACHE - 1):].T

    def kvflow_layer(self) -> ShortConv:
        cfg = ModelConfig.from_hf_dict(self.config.to_dict())
        assert cfg.recurrent.kind == SHORT_CONV and cfg.recurrent.layers == (0,)
        layer = ShortConv(cfg).eval()
        with torch.no_grad():
            layer.in_proj.weight.copy_(self.module.in_proj.weight)
            layer.out_proj.weight.copy_(self.module.out_proj.weight)
            layer.conv_weight.copy_(self.module.conv.weight.squeeze(1))
        return layer


def test_short_conv_matches_transformers_with_its_cache_over_chunks_decodes_and_runs():
    """Two requests in each step, each in its own slot (a spare slot between them stays untouched): prompts, a
    chunked continuation beside a decode, then decodes; every row's output equals transformers' module with its
    cache, and every slot's state the last L - 1 inputs of transformers' cache (to float rounding: in_proj's matmul
    over the step's rows is not bit-equal to transformers' over one request's)."""
    ref = _Reference(_hf_config())
    layer = ref.kvflow_layer()
    ((shape, dtype),) = layer.state_shapes(torch.float32).values()
    assert shape == (L_CACHE - 1, HIDDEN) and dtype == torch.float32
    state = torch.zeros(3, *shape)
    state[1] = 7.0                      # a slot no run names keeps whatever it holds
    layer.bind_state({"conv": state})
    slots = {"a": 2, "b": 0}
    gen = torch.Generator().manual_seed(1)
    # per step: (request, rows) in flat-batch order (decode rows first, as the runner orders them)
    steps = [[("a", 7), ("b", 1)], [("b", 5), ("a", 4)], [("a", 1), ("b", 1)], [("a", 1), ("b", 2)],
             [("b", 1), ("a", 1)]]
    for step in steps:
        xs = [torch.randn(n, HIDDEN, generator=gen) for _, n in step]
        got = layer(torch.cat(xs), _meta([(n, slots[r]) for r, n in step]))
        want = torch.cat([ref(r, x) for (r, _), x in zip(step, xs)])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for r in {r for r, _ in step}:
            torch.testing.assert_close(state[slots[r]], ref.state(r), rtol=1e-4, atol=1e-5)
        assert torch.equal(state[1], torch.full(shape, 7.0))


def test_short_conv_snapshots_are_the_state_after_their_row():
    """A snapshot row's copy is the state a request has after that token: continuing from it gives what continuing
    the request does (prefix-cache checkpoints, speculative decoding's per-draft states)."""
    ref = _Reference(_hf_config(), seed=3)
    layer = ref.kvflow_layer()
    state = torch.zeros(4, L_CACHE - 1, HIDDEN)
    layer.bind_state({"conv": state})
    gen = torch.Generator().manual_seed(2)
    prompt, rest = torch.randn(9, HIDDEN, generator=gen), torch.randn(3, HIDDEN, generator=gen)
    layer(prompt, _meta([(9, 0)], snapshots=[(4, 2), (8, 3)]))
    assert torch.equal(state[3], state[0])              # after the last row: the slot's own state
    ref("a", prompt[:5])
    assert torch.equal(state[2], ref.state("a"))        # after row 4: the state of the first 5 tokens
    got = layer(rest, _meta([(3, 2)]))                  # continue from the snapshot as from a checkpoint
    torch.testing.assert_close(got, ref("a", rest), rtol=1e-5, atol=1e-6)


def test_short_conv_state_keeps_the_compute_dtype():
    layer = _Reference(_hf_config()).kvflow_layer()
    assert layer.state_shapes(torch.bfloat16) == {"conv": ((L_CACHE - 1, HIDDEN), torch.bfloat16)}
    assert layer.state_bytes_per_slot(torch.bfloat16) == 2 * (L_CACHE - 1) * HIDDEN


# ---- config.json and GGUF metadata --------------------------------------------------------------------------------

def test_config_reads_lfm2s_mlp_width_layers_and_aliases():
    """LiquidAI's config.json: block_ff_dim, tie_embedding, full_attn_idxs, no rope_theta (transformers' 1M); the
    MLP's width adjusted as Lfm2MLP adjusts it (LFM2-350M: 6656 -> 4608)."""
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 65536, "hidden_size": 1024,
        "block_ff_dim": 6656, "intermediate_size": 6656, "num_hidden_layers": 16, "num_attention_heads": 16,
        "num_key_value_heads": 8, "norm_eps": 1e-5, "conv_L_cache": 3, "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True, "tie_embedding": True,
        "full_attn_idxs": [2, 5, 8, 10, 12, 14], "max_position_embeddings": 128000})
    assert cfg.intermediate_size == 4608 and cfg.tie_word_embeddings and cfg.rope_theta == 1_000_000.0
    assert cfg.recurrent.layers == (0, 1, 3, 4, 6, 7, 9, 11, 13, 15) and cfg.recurrent.conv_kernel == 3
    assert cfg.rms_norm_eps == 1e-5 and cfg.qk_norm and cfg.head_dim == 64


@pytest.mark.slow
def test_gguf_twin_has_the_same_config_and_tensor_names(tmp_path):
    """llama.cpp's LFM2 metadata (per-layer KV heads, 0 for a convolution; shortconv.l_cache; the adjusted MLP
    width, not adjusted again) gives the config.json's ModelConfig, and its tensors the checkpoint's names (the
    convolution squeezed to [hidden, L], as llama.cpp stores it)."""
    from kvflow.models.loader import iter_weights
    from kvflow.models.model_files import resolve_model_files
    from tiny_models import make_tiny_hf_model, write_gguf_from_hf

    path = make_tiny_hf_model(tmp_path / "hf", family="lfm2", seed=1)
    gguf_path = write_gguf_from_hf(path, tmp_path / "lfm2.gguf")
    a, b = resolve_model_files(path), resolve_model_files(gguf_path)
    assert a.config == b.config and a.config.intermediate_size == 96 and a.config.recurrent.layers == (0, 1, 3, 4)
    ours = {n: tuple(t.shape) for n, t in iter_weights(a)}
    theirs = {n: tuple(t.shape) for n, t in iter_weights(b)}
    assert set(ours) == set(theirs) and "model.embedding_norm.weight" in theirs
    assert {n for n in ours if ours[n] != theirs[n]} == {f"model.layers.{i}.conv.conv.weight" for i in (0, 1, 3, 4)}
    assert theirs["model.layers.0.conv.conv.weight"] == (64, 3)


# ---- what the model refuses ------------------------------------------------------------------------------------

def _tiny_config() -> ModelConfig:
    return ModelConfig.from_hf_dict(_hf_config().to_dict())


def test_lora_on_convolutions_and_tensor_parallelism_are_refused_by_name():
    from kvflow.models.lfm2 import Lfm2ForCausalLM
    from kvflow.layers.native_layers import NotNative

    cfg = _tiny_config()
    model = Lfm2ForCausalLM(cfg, 64)
    assert len(model.attention_layers) == 1 and [type(m) for m in model.state_layers] == [ShortConv]
    assert model.compiled_decode is False
    with pytest.raises(ValueError, match="conv.in_proj is a projection of LFM2's short convolution"):
        model.enable_lora(1, 8, targets=("q_proj", "in_proj"))        # LoRA: not on the convolutions
    with pytest.raises(NotNative, match="state slots are not allocated"):     # the runner binds them first
        model.native_decoder()

    class TwoRanks:
        size = 2

    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        Lfm2ForCausalLM(cfg, 64, TwoRanks())


# ---- the whole model through kvflow.LLM ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lfm2_files(tmp_path_factory):
    """The tiny LFM2 (tests/tiny_models.py: attention at layers 2 and 5) and its GGUF twins, f32 and Q8_0."""
    from tiny_models import make_tiny_hf_model, write_gguf_from_hf

    folder = tmp_path_factory.mktemp("lfm2")
    path = make_tiny_hf_model(folder / "hf", family="lfm2", seed=2)
    ggufs = {}
    for ftype in ("f32", "q8_0"):       # one folder each: transformers loads a GGUF by folder and file name
        (folder / ftype).mkdir()
        ggufs[ftype] = write_gguf_from_hf(path, folder / ftype / f"lfm2-{ftype}.gguf", ftype=ftype)
    return path, ggufs


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    # one longer than max_num_batched_tokens (chunked), one of a single token, two sharing a 40-token prefix
    shared = torch.randint(10, 40000, (40,), generator=g).tolist()
    return [torch.randint(10, 40000, (n,), generator=g).tolist() for n in (5, 19, 150, 1)] + [
        shared + [11, 12, 13], shared + [21, 22, 23, 24, 25]]


def _generate(llm: LLM, prompts, logprobs: bool = False):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0 if logprobs else None)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    if not logprobs:
        return [o.token_ids for o in outs]
    return [(o.token_ids, [next(iter(d.values())) for d in o.logprobs]) for o in outs]


def _hf(path, gguf=None):
    from transformers import AutoModelForCausalLM

    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.mark.slow
def test_greedy_tokens_match_transformers_chunked_batched_alone_and_from_the_prefix_cache(lfm2_files):
    from transformers_greedy import assert_greedy_matches

    path, _ = lfm2_files
    hf = _hf(path)
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
              max_num_batched_tokens=BATCHED_TOKENS)
    assert len(llm.engine.runner.state_layers) == 4
    prompts = _prompts()
    batched = _generate(llm, prompts)
    for p, got in zip(prompts, batched):
        assert_greedy_matches(hf, p, got, "LFM2 (batched), ", MAX_TOKENS)
    assert len({t for got in batched for t in got}) > 4 * MAX_TOKENS      # tokens that move: a test that can fail
    # alone (the chunked prompt, the one-token prompt, one of the pair): the same tokens (transformers' too)
    assert [_generate(llm, [prompts[i]])[0] for i in (2, 3, 5)] == [batched[i] for i in (2, 3, 5)]
    # again: the prompts' full blocks are prefix-cache hits, their convolution states restored from checkpoints
    hits = llm.engine.kv_cache_manager.prefix_cache_hits
    assert _generate(llm, prompts) == batched
    assert llm.engine.kv_cache_manager.prefix_cache_hits > hits
    llm.engine.kv_cache_manager.check()


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["f32", "q8_0"])
def test_gguf_twin_matches_transformers_loading_the_same_file(lfm2_files, ftype):
    """llama.cpp's LFM2 GGUF (f32, and Q8_0 read as floats under dtype=float32) against transformers' own load of
    the same file, token for token."""
    from transformers_greedy import assert_greedy_matches

    _, ggufs = lfm2_files
    hf = _hf(None, ggufs[ftype])
    llm = LLM(str(ggufs[ftype]), dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
              max_num_batched_tokens=BATCHED_TOKENS)
    assert llm.engine.runner.quantization is None
    prompts = _prompts()[:4]
    for p, got in zip(prompts, _generate(llm, prompts)):
        assert_greedy_matches(hf, p, got, f"LFM2 GGUF {ftype}, ", MAX_TOKENS)


@pytest.mark.slow
def test_speculative_decoding_gives_transformers_tokens_after_rejected_drafts(tmp_path):
    """n-gram drafts, some rejected: a rejected draft has already gone through the convolutions, so the state after
    the last accepted token comes back from its snapshot; the tokens stay transformers' greedy ones. (Matrices of
    scale 0.07: the tiny model's greedy output repeats itself enough for the drafts to find matches, and still
    depends on the states: without the snapshots, 4 of the 6 prompts leave transformers' tokens.)"""
    from tiny_models import make_tiny_hf_model
    from transformers_greedy import assert_greedy_matches

    path = make_tiny_hf_model(tmp_path, family="lfm2", seed=2, matrix_std=0.07)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB", speculative_config=ngram)
    prompts = _prompts()
    got = _generate(llm, prompts)
    sched = llm.engine.scheduler
    assert 0 < sched.spec_num_accepted_tokens < sched.spec_num_draft_tokens      # accepted ones and rejected ones
    hf = _hf(path)
    for p, tokens in zip(prompts, got):
        assert_greedy_matches(hf, p, tokens, "LFM2 (speculating), ", MAX_TOKENS)
    llm.engine.kv_cache_manager.check()


@pytest.mark.slow
def test_q8_0_codes_are_batch_and_chunking_invariant(lfm2_files):
    """Served from the file's Q8_0 codes (the default for a quantized GGUF): each prompt's tokens, and with kvflow's
    kernels their logprobs bit for bit, are the same alone as among the others, and whatever the prompt's chunks."""
    _, ggufs = lfm2_files
    prompts = _prompts()
    llm = LLM(str(ggufs["q8_0"]), max_model_len=256, kv_cache_memory="32MiB", max_num_batched_tokens=BATCHED_TOKENS)
    assert llm.engine.runner.quantization == "gguf"
    batched = _generate(llm, prompts, logprobs=True)
    alone = [_generate(llm, [p], logprobs=True)[0] for p in prompts]
    small_chunks = LLM(str(ggufs["q8_0"]), max_model_len=256, kv_cache_memory="32MiB", max_num_batched_tokens=13,
                       enable_prefix_caching=False)
    chunked = _generate(small_chunks, prompts, logprobs=True)
    if build.usable():      # kvflow's kernels: every row's arithmetic is its own
        assert alone == batched and chunked == batched
    else:
        tokens = [t for t, _ in batched]
        assert [t for t, _ in alone] == tokens and [t for t, _ in chunked] == tokens
