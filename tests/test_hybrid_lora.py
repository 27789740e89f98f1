"""LoRA adapters on the hybrid families (LFM2, Qwen3.5, Granite 4.0 H): adapters made by peft over tiny random models
on their attention and MLP projections under each checkpoint's own names, kvflow's greedy tokens against transformers
+ peft (unmerged) in float32: two adapters and the base model in one batch, each row its own adapter; alone; from a
prefix-cache hit, whose state checkpoint is the adapter's own; the GGUF twins (f32 against transformers + peft, Q8_0
on kvflow's kernels alone as in a batch). `--lora-target-modules` in the family's names; adapters or targets on the
recurrent mixers' projections refused, naming the module."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow import LLM, LoRARequest, SamplingParams
from kvflow.models.lora_adapter import LoRAAdapterError
from kvflow.models.lora_modules import lora_modules
from test_lora import make_adapter
from tiny_models import make_tiny_hf_model
from transformers_greedy import assert_greedy_matches

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# family -> two adapters: name -> (rank, PEFT target_modules, rsLoRA). "all" adapts every attention and MLP
# projection the family has (LFM2's attention out_proj named by its path: "out_proj" alone is also the
# convolution's); "some" a few of them, with another rank
ADAPTERS = {
    "lfm2": {"all": (8, ["q_proj", "k_proj", "v_proj", "self_attn.out_proj", "w1", "w3", "w2"], False),
             "some": (4, ["q_proj", "self_attn.out_proj", "w3"], True)},
    "qwen3_5": {"all": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
                "some": (4, ["q_proj", "v_proj", "down_proj"], True)},
    "granitemoehybrid": {"all": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "input_linear", "output_linear"], False),
                         "some": (4, ["k_proj", "o_proj", "input_linear"], True)},
}
# family -> (PEFT target on a recurrent mixer's projection, the module kvflow names refusing it)
RECURRENT = {"lfm2": [("in_proj", "conv.in_proj"), ("out_proj", "conv.out_proj")],
             "qwen3_5": [("in_proj_qkv", "linear_attn.in_proj_qkv"), ("linear_attn.out_proj", "linear_attn.out_proj")],
             "granitemoehybrid": [("in_proj", "mamba.in_proj"), ("out_proj", "mamba.out_proj")]}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(10, 40000, (n,), generator=g).tolist() for n in (5, 23, 41)]


@pytest.fixture(scope="module", params=list(ADAPTERS))
def family(request, tmp_path_factory):
    """(family, model folder, its transformers model, adapter name -> folder)."""
    from transformers import AutoModelForCausalLM

    name = request.param
    root = tmp_path_factory.mktemp(f"lora-{name}")
    path = make_tiny_hf_model(root / "base", family=name, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    adapters = {a: str(make_adapter(hf, root / a, r, targets, seed=i + 1, rslora=rs))
                for i, (a, (r, targets, rs)) in enumerate(ADAPTERS[name].items())}
    return name, path, hf, adapters


@pytest.fixture(scope="module")
def engine(family) -> LLM:
    _, path, _, _ = family
    return LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="64MiB", enable_lora=True, max_loras=2,
               max_lora_rank=8)


def with_adapter(hf, adapter: str | None):
    """transformers + peft (unmerged) over `hf`, or `hf` itself."""
    from peft import PeftModel

    return hf if adapter is None else PeftModel.from_pretrained(hf, adapter).eval()


def requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}


def test_two_adapters_and_the_base_in_one_batch_equal_transformers_peft(family, engine):
    name, path, hf, adapters = family
    loras = [None, *requests(adapters).values()]
    jobs = [(p, lora) for p in prompts() for lora in loras]
    got = [o.outputs[0].token_ids for o in engine.generate([p for p, _ in jobs], GREEDY,
                                                           lora_request=[lora for _, lora in jobs])]
    for lora in loras:
        model = with_adapter(hf, None if lora is None else adapters[lora.lora_name])
        for (prompt, job_lora), tokens in zip(jobs, got):
            if job_lora is lora:
                assert_greedy_matches(model, prompt, tokens, f"{name}, adapter {lora and lora.lora_name}: ", MAX_TOKENS)
        if lora is not None:
            model.unload()          # the base model back as it was, for the next adapter
    # each adapter changes the output (else the comparison proves nothing)
    for k in range(1, len(loras)):
        assert any(got[i + k] != got[i] for i in range(0, len(jobs), len(loras))), loras[k].lora_name
    # alone: what it got in the mixed batch
    for k in (1, 2):
        assert engine.generate([jobs[-k][0]], GREEDY, lora_request=jobs[-k][1])[0].outputs[0].token_ids == got[-k]
    engine.engine.kv_cache_manager.check()


@pytest.mark.slow
def test_gguf_twins_with_adapters(family, tmp_path):
    """The model's GGUF twins (llama.cpp's names and row orders, turned back at load) with the adapters made on the HF
    folder: f32 at dtype float32 gives transformers + peft's tokens (two adapters and the base in one batch); Q8_0 at
    the default dtype (its codes on kvflow's kernels, where they run) gives each request what it gets alone."""
    from kvflow.kernels import build
    from kvflow.layers.lora import LoRAStack
    from tiny_models import write_gguf_from_hf

    name, path, hf, adapters = family
    loras = [None, *requests(adapters).values()]
    jobs = [(p, lora) for p in prompts()[1:] for lora in loras]

    def serve(gguf, **engine) -> tuple[LLM, list[list[int]]]:
        llm = LLM(str(gguf), max_model_len=256, kv_cache_memory="64MiB", enable_lora=True, max_loras=2,
                  max_lora_rank=8, **engine)
        return llm, [o.outputs[0].token_ids for o in llm.generate([p for p, _ in jobs], GREEDY,
                                                                   lora_request=[lora for _, lora in jobs])]

    _, got = serve(write_gguf_from_hf(path, tmp_path / f"{name}.gguf", "f32"), dtype="float32")
    for lora in loras:
        model = with_adapter(hf, None if lora is None else adapters[lora.lora_name])
        for (prompt, job_lora), tokens in zip(jobs, got):
            if job_lora is lora:
                assert_greedy_matches(model, prompt, tokens, f"{name} GGUF, adapter {lora and lora.lora_name}: ",
                                      MAX_TOKENS)
        if lora is not None:
            model.unload()
    # no prefix cache: each request alone computes its whole prompt again
    llm, mixed = serve(write_gguf_from_hf(path, tmp_path / f"{name}-q8_0.gguf", "q8_0"), enable_prefix_caching=False)
    stacks = [m for m in llm.engine.runner.model.modules() if isinstance(m, LoRAStack)]
    assert llm.engine.runner.quantization == "gguf" and all(s.native == build.usable() for s in stacks)
    for i in range(0, len(jobs), len(loras)):
        assert mixed[i + 1] != mixed[i] and mixed[i + 2] != mixed[i], f"prompt {i // 3}: an adapter did nothing"
    alone = [llm.generate([p], GREEDY, lora_request=lora)[0].outputs[0].token_ids for p, lora in jobs]
    assert alone == mixed


def test_prefix_cache_and_state_checkpoints_are_per_adapter(family, engine):
    """The same prompt under one adapter, the other, the base model and the first again: only the last hits the
    prefix cache (KV blocks and the recurrent layers' state checkpoint of that adapter) and gives the same tokens."""
    _, _, _, adapters = family
    kv = engine.engine.kv_cache_manager
    first, second = requests(adapters).values()
    ids = torch.randint(10, 40000, (40,), generator=torch.Generator().manual_seed(5)).tolist()   # two whole blocks

    def gen(lora):
        hits = kv.prefix_cache_hits
        out = engine.generate([ids], GREEDY, lora_request=lora)[0].outputs[0].token_ids
        return out, kv.prefix_cache_hits - hits

    out_first, hits = gen(first)
    assert hits == 0
    assert gen(second)[1] == 0 and gen(None)[1] == 0
    again, hits = gen(first)
    assert hits > 0 and again == out_first
    kv.check()


def test_lora_target_modules_in_the_family_names_and_recurrent_layers_without_terms(family):
    name, path, hf, adapters = family
    only = {"lfm2": ("w3", "q_proj", "out_proj"), "qwen3_5": ("q_proj", "down_proj", "v_proj"),
            "granitemoehybrid": ("input_linear", "o_proj", "k_proj")}[name]
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enable_lora=True,
              max_lora_rank=8, lora_target_modules=only)
    model = llm.engine.runner.model
    cfg = model.config
    # every module an adapter may adapt has its place in a fused projection (else its tensors would be read and
    # dropped), and nothing else has one
    placed = [m for terms in model.LORA_TARGETS.values() for _, _, modules in terms for m in modules]
    assert sorted(placed) == sorted(lora_modules(cfg).shapes)
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, "self_attn", None)
        assert (attn is None) == cfg.is_recurrent(i), i
        if attn is not None:        # q (and v) of qkv_proj, and o_proj
            assert attn.qkv_lora.num_pieces == (2 if "v_proj" in only else 1) and \
                (attn.o_lora is not None) == ("o_proj" in only or "out_proj" in only), i
        mlp = layer.mlp
        assert (mlp.gate_up_lora is not None) == any(t in only for t in ("w3", "input_linear")), i
        assert (mlp.down_lora is not None) == ("down_proj" in only), i
    # no recurrent mixer holds a LoRA term
    for mixer in model.state_layers:
        assert not any("lora" in n for n, _ in mixer.named_modules()), type(mixer).__name__
    lora = LoRARequest("some", 2, adapters["some"])
    tokens = llm.generate([prompts()[1]], GREEDY, lora_request=lora)[0].outputs[0].token_ids
    model_peft = with_adapter(hf, adapters["some"])
    assert_greedy_matches(model_peft, prompts()[1], tokens, f"{name}, --lora-target-modules {only}: ", MAX_TOKENS)
    model_peft.unload()
    with pytest.raises(ValueError, match="adapts .*which this server has no LoRA slots"):
        llm.generate([prompts()[1]], GREEDY, lora_request=LoRARequest("all", 1, adapters["all"]))


def test_lora_target_modules_the_family_lacks_are_refused(family):
    name, path, _, _ = family
    target, words = {"lfm2": ("gate_proj", "its projections are q_proj, k_proj, v_proj, out_proj, w1, w3, w2"),
                     "granitemoehybrid": ("out_proj", "mamba.out_proj is a projection of Granite 4.0 H's Mamba2 mixer"),
                     "qwen3_5": ("out_proj", "linear_attn.out_proj is a projection of Qwen3.5's Gated DeltaNet")}[name]
    with pytest.raises(ValueError, match=f"lora_target_modules \\['{target}'\\].*{words}"):
        LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="8MiB", enable_lora=True,
            lora_target_modules=("q_proj", target))


def test_adapters_on_recurrent_projections_are_refused_naming_them(family, engine, tmp_path):
    """PEFT target_modules naming a recurrent mixer's projection (refused from the adapter's config), or a name that
    PEFT matches there too (LFM2's "out_proj": the attention's and the convolution's; refused from its tensors)."""
    name, _, hf, _ = family
    for k, (target, module) in enumerate(RECURRENT[name]):
        path = make_adapter(hf, tmp_path / target, 4, ["q_proj", target], seed=9)
        with pytest.raises(LoRAAdapterError, match=f"{module}.*recurrent layer"):
            engine.generate([prompts()[0]], GREEDY, lora_request=LoRARequest(f"bad{k}", 90 + k, str(path)))
    # the engine serves on
    assert len(engine.generate([prompts()[0]], GREEDY)[0].outputs[0].token_ids) == MAX_TOKENS


def test_adapter_for_attention_on_a_layer_that_is_recurrent_is_refused(family, engine, tmp_path):
    """An adapter made for another layout (attention where the base model has a recurrent layer) is refused before
    it runs, naming the layer."""
    from safetensors.torch import load_file, save_file

    _, _, _, adapters = family
    cfg = engine.engine.model_config
    attention = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_recurrent(i))
    recurrent = cfg.recurrent.layers[0]
    src, out = Path(adapters["some"]), tmp_path / "moved"
    out.mkdir()
    (out / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    moved = {k.replace(f"layers.{attention}.self_attn", f"layers.{recurrent}.self_attn"): v for k, v in tensors.items()}
    assert moved.keys() != tensors.keys()
    save_file(moved, str(out / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match=f"of layer {recurrent}, which is a recurrent layer"):
        engine.generate([prompts()[0]], GREEDY, lora_request=LoRARequest("moved", 80, str(out)))
