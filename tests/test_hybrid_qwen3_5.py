"""Qwen3.5 (kvflow/models/qwen3_5.py) against transformers 5.24's Qwen3_5ForCausalLM in float32: the Gated DeltaNet
layer (a prompt through transformers' chunked path, a second chunk, then decode tokens through its recurrent path;
outputs and the states after them) and the gated attention layer; the whole model's logits loaded from an HF folder,
a Qwen3_5ForConditionalGeneration folder and llama.cpp's GGUF layout (against transformers' own GGUF load); then
through kvflow.LLM: greedy tokens (chunked prefill, batched and alone bit for bit, prefix-cache checkpoints,
speculation rolled back), the GGUF twins and the default configuration's batch invariance, chat."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from kvflow.distributed.parallel_state import TensorParallel
from kvflow.kernels.recurrent import StateBatch
from kvflow.layers.attention_metadata import AttentionMetadata, PrefillBatch
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.llama import TensorParallelSizes
from kvflow.models.model_config import GATED_DELTA_NET, ModelConfig
from kvflow.models.model_files import resolve_model_files
from kvflow.models.qwen3_5 import GatedAttention, GatedDeltaNet, Qwen3_5ForCausalLM
from tiny_models import make_tiny_hf_model, write_gguf_from_hf

TOL = 1e-4


def text_config(**overrides):
    """The tiny model's shape (tests/tiny_models.py) as transformers' config: 3 Gated DeltaNet layers : 1 gated
    attention, 4 key heads for 8 value heads."""
    from transformers import Qwen3_5TextConfig

    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25, rope_theta=10000.0,
                  max_position_embeddings=512, rms_norm_eps=1e-6, full_attention_interval=4, linear_num_key_heads=4,
                  linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4)
    kwargs.update(overrides)
    config = Qwen3_5TextConfig(**kwargs)
    config._attn_implementation = "eager"
    return config


def kvflow_config(config) -> ModelConfig:
    return ModelConfig.from_hf_dict({**config.to_dict(), "architectures": ["Qwen3_5ForCausalLM"]})


def randomize(module, seed: int) -> None:
    """Distinct values everywhere; decays from long memory (A ~ 0.02) to fast forgetting (A ~ 4)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(-4.0, 1.4, generator=gen))
            elif name == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen) - 1.0)
            elif name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen) + (1.0 if name == "norm.weight" else 0.0))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def runs(lengths: list[int], slots: list[int]) -> StateBatch:
    starts = torch.tensor([0] + lengths).cumsum(0)
    empty = torch.empty(0, dtype=torch.long)
    return StateBatch(starts, torch.tensor(slots), empty, empty)


def gdn_pair(config, seed: int = 0):
    """transformers' Qwen3_5GatedDeltaNet (random weights) and kvflow's with the same weights, its states bound to
    4 zeroed slots."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    ref = Qwen3_5GatedDeltaNet(config, 0).eval()
    randomize(ref, seed)
    cfg = kvflow_config(config)
    ours = GatedDeltaNet(cfg)
    with torch.no_grad():
        ours.in_proj_qkvz.weight.copy_(torch.cat([ref.in_proj_qkv.weight, ref.in_proj_z.weight]))
        ours.in_proj_ba.weight.copy_(torch.cat([ref.in_proj_b.weight, ref.in_proj_a.weight]))
        ours.conv1d.weight.copy_(ref.conv1d.weight.squeeze(1))
        for name in ("dt_bias", "A_log"):
            getattr(ours, name).copy_(getattr(ref, name))
        ours.norm.weight.copy_(ref.norm.weight)
        ours.out_proj.weight.copy_(ref.out_proj.weight)
    ours.bind_state({name: torch.zeros(4, *shape, dtype=dtype)
                     for name, (shape, dtype) in ours.state_shapes(torch.float32).items()})
    return ref, ours


def test_config_reads_the_hybrid_layout():
    cfg = kvflow_config(text_config())
    rc = cfg.recurrent
    assert rc.kind == GATED_DELTA_NET and rc.layers == (0, 1, 2, 4, 5, 6) and rc.conv_kernel == 4
    assert (rc.num_key_heads, rc.num_value_heads, rc.key_head_dim, rc.value_head_dim) == (4, 8, 16, 16)
    assert cfg.attn_output_gate and cfg.qk_norm and cfg.rotary_dim == 8 and cfg.head_dim == 32
    _, ours = gdn_pair(text_config())
    shapes = ours.state_shapes(torch.bfloat16)
    assert shapes == {"conv": ((3, 2 * 4 * 16 + 8 * 16), torch.bfloat16), "recurrent": ((8, 16, 16), torch.float32)}


@torch.no_grad()
def test_gated_delta_net_matches_transformers_chunked_then_recurrent():
    """A 37-token prompt (transformers: its chunked form, 64-token chunks), a second chunk of 9 (chunked, from the
    state), then 4 decode tokens (its recurrent form): kvflow's token-by-token recurrence gives the same outputs and
    the same states after each part, within float32 rounding."""
    from transformers import DynamicCache

    config = text_config()
    ref, ours = gdn_pair(config)
    cache = DynamicCache(config=config)
    gen = torch.Generator().manual_seed(1)
    slot = 2
    for n in (37, 9, 1, 1, 1, 1):
        x = torch.randn(1, n, config.hidden_size, generator=gen)
        want = ref(x, cache=cache)
        got = ours(x[0], AttentionMetadata(torch.zeros(n, dtype=torch.long), 0, state=runs([n], [slot])))
        torch.testing.assert_close(got, want[0], rtol=TOL, atol=TOL)
        torch.testing.assert_close(ours.states["recurrent"][slot], cache.get_recurrent_state(0)[0], rtol=TOL,
                                   atol=TOL)
        conv = cache.get_conv_state(0)[0]                                  # [channels, K]: the last K inputs
        torch.testing.assert_close(ours.states["conv"][slot], conv[:, 1:].T, rtol=TOL, atol=TOL)
    assert ours.states["recurrent"][[0, 1, 3]].abs().max() == 0, "another slot's state changed"


@torch.no_grad()
def test_gated_delta_net_runs_of_a_step_are_independent_requests():
    """Three requests in one flat batch (a prefill chunk, a decode, another chunk), each continuing its own slot:
    each gives what it gives alone."""
    config = text_config()
    _, ours = gdn_pair(config, seed=4)
    gen = torch.Generator().manual_seed(5)
    lengths, slots = [11, 1, 6], [3, 0, 1]
    warm = torch.randn(5, config.hidden_size, generator=gen)
    for s in slots:         # give every slot some history first
        ours(warm, AttentionMetadata(torch.zeros(5, dtype=torch.long), 0, state=runs([5], [s])))
    saved = {name: t.clone() for name, t in ours.states.items()}
    x = torch.randn(sum(lengths), config.hidden_size, generator=gen)
    batched = ours(x, AttentionMetadata(torch.zeros(len(x), dtype=torch.long), 0, state=runs(lengths, slots)))
    after = {name: t.clone() for name, t in ours.states.items()}
    start = 0
    for n, s in zip(lengths, slots):
        for name, t in ours.states.items():
            t.copy_(saved[name])
        alone = ours(x[start:start + n], AttentionMetadata(torch.zeros(n, dtype=torch.long), 0, state=runs([n], [s])))
        torch.testing.assert_close(batched[start:start + n], alone, rtol=TOL, atol=TOL)
        for name, t in ours.states.items():
            torch.testing.assert_close(after[name][s], t[s], rtol=TOL, atol=TOL)
        start += n


@torch.no_grad()
def test_gated_attention_matches_transformers():
    """q_proj's per-head query and gate, per-head q/k norms (1 + w), partial RoPE, o_proj(attention * sigmoid(gate))
    over a 23-token prompt."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5TextRotaryEmbedding

    config = text_config()
    ref = Qwen3_5Attention(config, 3).eval()
    randomize(ref, 7)
    cfg = kvflow_config(config)
    tp = TensorParallel()
    rotary = RotaryEmbedding(cfg.head_dim, 64, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)
    ours = GatedAttention(cfg, rotary, tp, TensorParallelSizes(cfg, tp), 3)
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight]))
        ours.o_proj.weight.copy_(ref.o_proj.weight)
        ours.q_norm.weight.copy_(1.0 + ref.q_norm.weight)
        ours.k_norm.weight.copy_(1.0 + ref.k_norm.weight)
    T = 23
    ours.attn.k_cache = torch.zeros(4, 16, cfg.num_key_value_heads, cfg.head_dim)
    ours.attn.v_cache = torch.zeros_like(ours.attn.k_cache)
    rows = torch.arange(T)
    meta = AttentionMetadata(rows, 0, prefill=PrefillBatch(1, T, T, rows, rows, rows, None))
    x = torch.randn(1, T, config.hidden_size, generator=torch.Generator().manual_seed(8))
    positions = torch.arange(T)
    cos_sin = Qwen3_5TextRotaryEmbedding(config)(x, positions[None])
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    want, _ = ref(x, cos_sin, mask)
    got = ours(rotary.lookup(positions), x[0], meta)
    torch.testing.assert_close(got, want[0], rtol=TOL, atol=TOL)


# ---- the whole model, loaded ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen3_5"), family="qwen3_5", seed=3)


def loaded(path, mtp: bool = False) -> Qwen3_5ForCausalLM:
    """kvflow's model (with its MTP block: `mtp`), KV caches of 16 blocks of 16 and 2 state slots (zeroed)."""
    from kvflow.models.loader import iter_weights

    files = resolve_model_files(path)
    model = Qwen3_5ForCausalLM(files.config, 256)
    if mtp:
        model.enable_mtp()
    model.load_weights(iter_weights(files))
    for attn in model.attention_layers:
        attn.k_cache = torch.zeros(16, 16, attn.num_kv_heads, attn.head_dim)
        attn.v_cache = torch.zeros_like(attn.k_cache)
    for layer in model.state_layers:
        layer.bind_state({name: torch.zeros(2, *shape, dtype=dtype)
                          for name, (shape, dtype) in layer.state_shapes(torch.float32).items()})
    return model.eval()


@torch.no_grad()
def logits_of(model: Qwen3_5ForCausalLM, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prompt, one prefill chunk (slot 0, zeroed first)."""
    for layer in model.state_layers:
        for t in layer.states.values():
            t.zero_()
    T = len(ids)
    rows = torch.arange(T)
    meta = AttentionMetadata(rows, 0, prefill=PrefillBatch(1, T, T, rows, rows, rows, None), state=runs([T], [0]))
    return model.compute_logits(model(torch.tensor(ids), rows, meta))


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.slow
@torch.no_grad()
def test_model_logits_match_transformers(tiny_qwen3_5):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5, dtype=torch.float32).eval()
    model = loaded(tiny_qwen3_5)
    assert len(model.state_layers) == 6 and len(model.attention_layers) == 2 and not model.compiled_decode
    ids = prompt(40)
    want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(model, ids), want, rtol=TOL, atol=TOL)


def test_conditional_generation_folder_serves_the_text_model(tiny_qwen3_5, tmp_path, caplog):
    """A Qwen3_5ForConditionalGeneration folder: text_config beside a vision_config, the text model's tensors under
    model.language_model., a vision tower's under model.visual. and an MTP block's under mtp.: the text model
    loads, the rest is skipped and said so."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((tiny_qwen3_5 / "config.json").read_text())
    outer = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
             "text_config": {**cfg, "tie_word_embeddings": True},      # the outer config's says (transformers)
             "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 16},
             "tie_word_embeddings": False, "image_token_id": 5}
    (tmp_path / "config.json").write_text(json.dumps(outer))
    tensors = {}
    for name, t in load_file(tiny_qwen3_5 / "model.safetensors").items():
        tensors[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 4, 4)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(48, 16)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.layers.0.self_attn.q_proj.weight"] = torch.randn(256, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    for f in tiny_qwen3_5.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    files = resolve_model_files(tmp_path)
    assert files.config.architecture == "Qwen3_5ForConditionalGeneration" and not files.config.tie_word_embeddings
    with caplog.at_level(logging.INFO, logger="kvflow.models.qwen3_5"):
        model = loaded(tmp_path)
    assert "skipped 2 vision tower tensor(s)" in caplog.text and "skipped 2 multi-token prediction" in caplog.text
    ids = prompt(12, seed=1)
    torch.testing.assert_close(logits_of(model, ids), logits_of(loaded(tiny_qwen3_5), ids), rtol=0, atol=0)


@pytest.mark.slow
# (transformers reads no Q5_0/Q5_1, and the tiny model's widths are not the K-quants' multiple of 256)
@pytest.mark.parametrize("ftype", ["f32", "f16", "bf16", "q4_0", "q8_0"])
def test_gguf_matches_transformers_gguf_load(tiny_qwen3_5, tmp_path, ftype):
    """llama.cpp's layout (norms as 1 + w, ssm_a = -exp(A_log), squeezed taps, value heads tiled since Hk < Hv), in
    each weight format the dense models take: kvflow's float32 load of the file gives transformers' own GGUF load's
    logits (the file's values)."""
    from transformers import AutoModelForCausalLM

    gguf_path = write_gguf_from_hf(tiny_qwen3_5, tmp_path / f"qwen3_5-{ftype}.gguf", ftype=ftype)
    a, b = resolve_model_files(tiny_qwen3_5).config, resolve_model_files(gguf_path).config
    fields = ("family", "recurrent", "attn_output_gate", "rotary_dim", "rope_theta", "head_dim", "num_hidden_layers",
              "tie_word_embeddings", "qk_norm", "rms_norm_eps", "intermediate_size")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    ids = prompt(30, seed=2)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(loaded(gguf_path), ids), want, rtol=TOL, atol=TOL)
    if ftype == "f32":          # and the safetensors' own
        torch.testing.assert_close(logits_of(loaded(tiny_qwen3_5), ids), want, rtol=TOL, atol=TOL)


@pytest.mark.slow
def test_gguf_with_an_mtp_block_serves_the_trunk(tiny_qwen3_5, tmp_path, caplog):
    """llama.cpp writes Qwen3.5's MTP block as a block after the trunk's (block_count counts it,
    nextn_predict_layers says how many) with its fc and norms as nextn.* tensors: kvflow reads the trunk's layer
    count, skips the block (saying so) and gives transformers' logits from its own load of the file."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from kvflow.models.gguf_reader import read_gguf

    folder = tmp_path / "hf"
    folder.mkdir()
    for f in tiny_qwen3_5.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tiny_qwen3_5 / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    tensors = load_file(tiny_qwen3_5 / "model.safetensors")
    tensors.update({n.replace("model.layers.3.", "mtp.layers.0."): t.clone() for n, t in tensors.items()
                    if n.startswith("model.layers.3.")})
    tensors.update({"mtp.fc.weight": torch.randn(64, 128), "mtp.pre_fc_norm_embedding.weight": torch.zeros(64),
                    "mtp.pre_fc_norm_hidden.weight": torch.zeros(64), "mtp.norm.weight": torch.zeros(64)})
    save_file(tensors, folder / "model.safetensors")
    gguf_path = write_gguf_from_hf(folder, tmp_path / "qwen3_5-mtp.gguf")
    g = read_gguf(gguf_path)
    assert g.metadata["qwen35.block_count"] == 9 and "blk.8.nextn.eh_proj.weight" in g.tensors
    assert resolve_model_files(gguf_path).config.num_hidden_layers == 8
    with caplog.at_level(logging.INFO, logger="kvflow.models.qwen3_5"):
        model = loaded(gguf_path)
    assert "multi-token prediction tensor(s)" in caplog.text
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    ids = prompt(20, seed=5)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(model, ids), want, rtol=TOL, atol=TOL)


def test_gguf_codes_come_out_in_the_checkpoints_order(tiny_qwen3_5, tmp_path):
    """Kept as codes (the default configuration's load), the tiled value heads' rows are picked back exactly (the
    codes' values are the float load's, bit for bit); out_proj, whose columns cross the codes' blocks, keeps the
    file's codes and order, with the order its input takes."""
    from kvflow.kernels.group_quant import CODES
    from kvflow.models.loader import iter_weights

    gguf_path = write_gguf_from_hf(tiny_qwen3_5, tmp_path / "qwen3_5-q8_0.gguf", ftype="q8_0")
    floats = dict(iter_weights(gguf_path))
    kept = dict(iter_weights(resolve_model_files(gguf_path), keep_quantized=True))
    orders = {n for n in kept if n.endswith(".input_order")}
    assert floats.keys() == kept.keys() - orders and len(orders) == 6      # one per Gated DeltaNet layer
    for name in ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.in_proj_z.weight",
                 "model.layers.4.linear_attn.in_proj_a.weight", "model.layers.4.linear_attn.in_proj_b.weight"):
        assert isinstance(kept[name], CODES), name
        assert torch.equal(kept[name].dequantize(), floats[name]), name
    out_proj, order = kept["model.layers.0.linear_attn.out_proj.weight"], kept[
        "model.layers.0.linear_attn.out_proj.input_order"]
    assert isinstance(out_proj, CODES) and "model.layers.0.linear_attn.out_proj.input_order" not in floats
    assert torch.equal(out_proj.dequantize()[:, torch.argsort(order)],
                       floats["model.layers.0.linear_attn.out_proj.weight"])


def test_lora_on_gated_deltanet_and_tensor_parallelism_are_refused_with_a_reason(tiny_qwen3_5):
    cfg = resolve_model_files(tiny_qwen3_5).config
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Qwen3_5ForCausalLM(cfg, 64, TensorParallel(size=2))
    with pytest.raises(ValueError, match="linear_attn.in_proj_z is a projection of Qwen3.5's Gated DeltaNet"):
        Qwen3_5ForCausalLM(cfg, 64).enable_lora(1, 8, targets=("q_proj", "in_proj_z"))
    from kvflow.layers.native_layers import NotNative
    with pytest.raises(NotNative, match="state slots are not allocated"):     # the runner binds them first
        Qwen3_5ForCausalLM(cfg, 64).native_decoder()


# ---- through kvflow.LLM ---------------------------------------------------------------------------------------------

MAX_TOKENS = 16
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def llm_prompts() -> list[list[int]]:
    """Short ones, one longer than max_num_batched_tokens (64: prefilled in chunks, the state carried between
    steps), two sharing a 40-token prefix (a prefix-cache checkpoint at their junction)."""
    shared = prompt(40, seed=11)
    return [prompt(5, seed=12), prompt(150, seed=13), [42], shared + prompt(7, seed=14), shared + prompt(3, seed=15),
            prompt(23, seed=16)]


def generate(llm, prompts, **params) -> list[list[int]]:
    from kvflow import SamplingParams

    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**{**GREEDY, **params}))]


@pytest.fixture(scope="module")
def hf_qwen3_5(tiny_qwen3_5):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_5, dtype=torch.float32).eval()


def make_llm(path, **engine):
    from kvflow import LLM

    return LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB", max_num_batched_tokens=64,
               **engine)


@pytest.mark.slow
def test_llm_greedy_matches_transformers_alone_batched_and_from_checkpoints(tiny_qwen3_5, hf_qwen3_5):
    """Greedy float32 tokens equal transformers' for every prompt, batched; each alone gives the same tokens bit for
    bit (batch invariance); a second pass of the same prompts starts from prefix-cache checkpoints and gives them
    again."""
    from transformers_greedy import assert_greedy_matches

    prompts = llm_prompts()
    with make_llm(tiny_qwen3_5, enable_prefix_caching=False) as llm:
        batched = generate(llm, prompts)
        alone = [generate(llm, [p])[0] for p in prompts]
    assert alone == batched, "a request's tokens depend on what shares its steps"
    for p, got in zip(prompts, batched):
        assert_greedy_matches(hf_qwen3_5, p, got, "qwen3_5, ", MAX_TOKENS)
    with make_llm(tiny_qwen3_5) as llm:
        first = generate(llm, prompts)
        hits = llm.engine.kv_cache_manager.prefix_cache_hits
        again = generate(llm, prompts)
        assert llm.engine.kv_cache_manager.prefix_cache_hits > hits, "no prefix-cache hit on the repeated prompts"
        llm.engine.kv_cache_manager.check()
    assert first == batched and again == batched, "prefix-cache checkpoints changed the output"


class ScriptedDrafter:
    """A drafter (kvflow/spec_decode's `Proposer`) that knows each prompt's greedy continuation and drafts its next
    `right` tokens then wrong ones, `right` cycling over 0..k from one draft to the next: drafts rejected at every
    position, and all accepted."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations
        self.drafts = 0

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        prompt = next(p for p in self.continuations if tuple(token_ids[:len(p)]) == p)
        done = len(token_ids) - len(prompt)
        true = self.continuations[prompt][done:done + k]
        right = self.drafts % (k + 1)
        self.drafts += 1
        return true[:right] + [t - 1 if t > 10 else t + 1 for t in true[right:]]

    def finished(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        pass


@pytest.mark.slow
def test_llm_speculation_restores_the_state_of_the_last_accepted_token(tiny_qwen3_5):
    """Drafts accepted in part (0 to k of them): the Gated DeltaNet state has absorbed the rejected ones, so the state
    after the last accepted token is restored from its snapshot. The tokens are those without speculation, batched
    and alone."""
    prompts = llm_prompts()[:4]
    with make_llm(tiny_qwen3_5) as llm:
        want = generate(llm, prompts, max_tokens=24)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with make_llm(tiny_qwen3_5, speculative_config=spec) as llm:
        sched = llm.engine.scheduler
        sched.proposer = ScriptedDrafter({tuple(p): w for p, w in zip(prompts, want)})
        assert generate(llm, prompts, max_tokens=24) == want
        assert [generate(llm, [p], max_tokens=24)[0] for p in prompts] == want
        assert 0 < sched.spec_num_accepted_tokens < sched.spec_num_draft_tokens


@pytest.mark.slow
def test_llm_gguf_twins_match_transformers(tiny_qwen3_5, hf_qwen3_5, tmp_path):
    """The f32 twin gives transformers' tokens from the safetensors; the Q8_0 one, at dtype float32 (the file's
    values as floats), transformers' tokens from its own load of that file; at the default configuration (the
    file's codes through kvflow's kernels) it is batch invariant."""
    from transformers import AutoModelForCausalLM

    from transformers_greedy import assert_greedy_matches

    prompts = llm_prompts()[:3]
    f32 = write_gguf_from_hf(tiny_qwen3_5, tmp_path / "qwen3_5-f32.gguf")
    with make_llm(f32) as llm:
        for p, got in zip(prompts, generate(llm, prompts)):
            assert_greedy_matches(hf_qwen3_5, p, got, "qwen3_5 f32 GGUF, ", MAX_TOKENS)
    q8 = write_gguf_from_hf(tiny_qwen3_5, tmp_path / "qwen3_5-q8_0.gguf", ftype="q8_0")
    hf_q8 = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=q8.name, dtype=torch.float32).eval()
    with make_llm(q8) as llm:
        for p, got in zip(prompts, generate(llm, prompts)):
            assert_greedy_matches(hf_q8, p, got, "qwen3_5 Q8_0 GGUF, ", MAX_TOKENS)
    from kvflow import LLM

    with LLM(str(q8), max_model_len=256, kv_cache_memory="32MiB", max_num_batched_tokens=64) as llm:
        assert llm.engine.runner.quantization == "gguf"
        batched = generate(llm, prompts)
        assert [generate(llm, [p])[0] for p in prompts] == batched


@pytest.mark.slow
def test_llm_serves_a_conditional_generation_folder_and_chats(tiny_qwen3_5, tmp_path):
    """A Qwen3_5ForConditionalGeneration folder (text_config, a vision tower's tensors) gives the text model's tokens;
    chat renders the folder's template (SmolLM2's here) and generates."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((tiny_qwen3_5 / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": cfg,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1}, "tie_word_embeddings": False}))
    tensors = {("model.language_model." + n.removeprefix("model.")) if n.startswith("model.") else n: t
               for n, t in load_file(tiny_qwen3_5 / "model.safetensors").items()}
    tensors["model.visual.blocks.0.mlp.linear_fc1.weight"] = torch.randn(8, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    for f in tiny_qwen3_5.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    prompts = llm_prompts()[:2]
    with make_llm(tiny_qwen3_5) as llm:
        want = generate(llm, prompts)
    with make_llm(tmp_path) as llm:
        assert generate(llm, prompts) == want
        from kvflow import SamplingParams

        out = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
                       SamplingParams(**GREEDY))[0]
        assert len(out.outputs[0].token_ids) == MAX_TOKENS and out.prompt_token_ids
