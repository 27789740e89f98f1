"""Mixtures of experts (Qwen3-MoE, OLMoE, GraniteMoE, Mixtral) on random-weight models with their real configs (small
shapes), token for token against transformers in float32, from HF folders and GGUF files; the experts batched by
expert and batch invariant (layers/moe.py); the variants kvflow does not implement refused at load."""
from __future__ import annotations

import json

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels import build, ops
from kvflow.layers.moe import ROUTER_ROWS, Router, SparseMoE, blocked_linear
from kvflow.models.model_files import resolve_model_files
from tiny_models import make_tiny_hf_model, write_gguf_from_hf
from transformers_greedy import assert_greedy_matches

MAX_TOKENS = 16
FAMILIES = ("qwen3_moe", "olmoe", "granitemoe", "mixtral")


def hf_model(path):
    from transformers import AutoModelForCausalLM

    # transformers' eager experts: the reference loop (its default grouped_mm is another summation)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(10, 40000, (n,), generator=g).tolist()     # noqa: E731
    return [rand(5), rand(19), rand(41), [42]]


def greedy(llm: LLM, batch: list[list[int]], n: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(batch, params)]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """One tiny HF folder per family (module-scoped: several tests read them)."""
    root = tmp_path_factory.mktemp("moe")
    return {f: make_tiny_hf_model(root / f, family=f, seed=11) for f in FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers_token_for_token(moe_dirs, family):
    path = moe_dirs[family]
    cfg = resolve_model_files(path).config
    assert cfg.num_experts == 8 and cfg.arch.moe_router
    hf = hf_model(path)
    batch = prompts()
    # the whole batch in one step, and chunked prefill: a budget of 13 cuts the 19- and 41-token prompts
    for engine in ({}, {"max_num_batched_tokens": 13}):
        llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="16MiB", **engine)
        got = greedy(llm, batch)
        for p, a in zip(batch, got):
            assert_greedy_matches(hf, p, a, f"{family} {engine}, ", MAX_TOKENS)
        # a mixed batch equals each request alone
        assert [greedy(llm, [p])[0] for p in batch] == got
        llm.engine.kv_cache_manager.check()


def test_each_family_reads_its_config(moe_dirs):
    q = resolve_model_files(moe_dirs["qwen3_moe"]).config
    assert (q.family, q.num_experts_per_tok, q.moe_intermediate_size, q.norm_topk_prob, q.qk_norm) == (
        "qwen3_moe", 3, 32, True, True)
    o = resolve_model_files(moe_dirs["olmoe"]).config
    assert (o.norm_topk_prob, o.arch.qk_norm_whole, o.moe_intermediate_size) == (False, True, 32)
    g = resolve_model_files(moe_dirs["granitemoe"]).config
    assert (g.arch.moe_router, g.embedding_multiplier, g.residual_multiplier, g.attention_multiplier,
            g.logits_scaling) == ("topk_softmax", 12.0, 0.22, 0.0625, 6.0)
    m = resolve_model_files(moe_dirs["mixtral"]).config
    assert (m.arch.moe_router, m.norm_topk_prob) == ("softmax_topk_renormalized", True)


@pytest.mark.slow
def test_qwen3_moe_dense_layers(tmp_path):
    """mlp_only_layers and decoder_sparse_step keep a dense MLP in those layers, as transformers builds them."""
    path = make_tiny_hf_model(tmp_path, family="qwen3_moe", seed=3, num_hidden_layers=3, mlp_only_layers=[0],
                              decoder_sparse_step=1)
    cfg = resolve_model_files(path).config
    assert cfg.dense_layers == (0,) and [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    hf = hf_model(path)
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="16MiB")
    for p, a in zip(prompts()[:2], greedy(llm, prompts()[:2])):
        assert_greedy_matches(hf, p, a, length=MAX_TOKENS)


# ---- the layer: grouped by expert, batch invariant ---------------------------------------------------------------

def _moe_layer(router: str = "softmax_topk", experts: int = 8, top_k: int = 3, hidden: int = 64,
               intermediate: int = 32) -> SparseMoE:
    torch.manual_seed(0)
    layer = SparseMoE(hidden, intermediate, experts, top_k, router, True, torch.nn.functional.silu)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.2 * torch.randn(p.shape))
    return layer.eval()


def test_router_rules():
    x = torch.randn(11, 64)
    w = torch.randn(8, 64)
    logits = x @ w.t()
    for kind in ("softmax_topk", "softmax_topk_renormalized", "topk_softmax"):
        r = Router(64, 8, 3, kind, norm_topk_prob=False)
        r.weight.data.copy_(w)
        weights, ids = r(x)
        assert torch.equal(ids, logits.topk(3).indices)
        probs = torch.softmax(logits, -1).topk(3).values
        want = {"softmax_topk": probs, "softmax_topk_renormalized": probs / probs.sum(-1, keepdim=True),
                "topk_softmax": torch.softmax(logits.topk(3).values, -1)}[kind]
        torch.testing.assert_close(weights, want)
    with pytest.raises(ValueError, match="sigmoid"):
        Router(64, 8, 2, "sigmoid", False)


def test_experts_equal_the_per_token_loop():
    """Grouping by expert gives each row what running its own k experts one by one gives, and an expert no row chose
    is never called."""
    layer = _moe_layer()
    x = torch.randn(23, 64)
    weights, ids = layer.gate(x)
    want = torch.stack([sum(weights[t, j] * layer.experts[int(ids[t, j])](x[t:t + 1])[0] for j in range(3))
                        for t in range(23)])
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)
    called = set()
    hooks = [e.register_forward_hook(lambda m, i, o, k=k: called.add(k)) for k, e in enumerate(layer.experts)]
    layer(x[:1])
    for h in hooks:
        h.remove()
    assert called == set(ids[0].tolist())         # at batch 1, only the row's top-k experts are read


@pytest.mark.skipif(not build.usable(), reason="kvflow's kernels do not run here")
def test_the_native_router_follows_each_rule_and_gives_a_row_its_bits_alone():
    """kernels/csrc/moe.c's router (the module path's and the native step's where the experts are on kvflow's kernels):
    each rule's choices and weights as the torch router gives them, and a row's bits the same alone, in any
    subset and in a step large enough to be split over threads."""
    from kvflow.layers.moe import ROUTERS

    x, w = torch.randn(37, 100), torch.randn(8, 100)       # 100: not a multiple of its 16 partial sums
    for rule, kind in enumerate(ROUTERS):
        for norm in (False, True):
            router = Router(100, 8, 3, kind, norm)
            router.weight.data.copy_(w)
            want_weights, want_ids = router(x)
            weights, ids = ops.moe_route(x, w, 3, rule, norm)
            assert torch.equal(ids, want_ids), (kind, norm)
            torch.testing.assert_close(weights, want_weights)
            for rows in (slice(0, 1), slice(5, 6), slice(3, 20)):
                alone = ops.moe_route(x[rows], w, 3, rule, norm)
                assert torch.equal(alone[0], weights[rows]) and torch.equal(alone[1], ids[rows])
    big, wide = torch.randn(1000, 96), torch.randn(64, 96)
    weights, ids = ops.moe_route(big, wide, 8, 0, True)
    for rows in (slice(0, 1), slice(500, 503), slice(990, 1000)):
        alone = ops.moe_route(big[rows], wide, 8, 0, True)
        assert torch.equal(alone[0], weights[rows]) and torch.equal(alone[1], ids[rows])
    with pytest.raises(ValueError, match="top 9 of 8"):
        ops.moe_route(x, w, 9, 0, False)


def test_router_logits_do_not_depend_on_the_rows_beside():
    x, w = torch.randn(37, 64), torch.randn(8, 64)
    full = blocked_linear(x, w)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 3 + ROUTER_ROWS + 1), slice(10, 37)):
        assert torch.equal(blocked_linear(x[rows], w), full[rows])


@pytest.mark.skipif(not build.usable(), reason="kvflow's kernels do not run here")
@pytest.mark.parametrize("bits", [4, 8, 5, 6])
def test_quantized_experts_in_one_native_call_are_bit_for_bit_batch_invariant(bits):
    """Experts on kvflow's kernels (4-, 8-, 5- and Q6_K's 6-bit codes, each row alone), stacked into one native call per layer
    (`use_native_kernels`): the call gives what the per-expert modules give (to float rounding: its SiLU is its own),
    and a row's output bits are the same alone, in any subset and in the whole step, whichever experts the other
    rows chose: steps of up to 1,024 (row, choice) pairs run every chosen expert's matrices as one pool job
    (kernels/csrc/moe.c's grouped_experts), larger ones one call per expert, and both give a row the same bits."""
    from kvflow.kernels.group_quant import GroupQuantized
    from kvflow.layers.int4 import Int4Linear
    from kvflow.layers.quantization import NativeQ8Linear

    from gguf import GGMLQuantizationType

    from kvflow.models.gguf_codes import group_quantized
    from tiny_models import quantize_q6_k

    hidden = 256 if bits == 6 else 64           # Q6_K: rows of whole blocks of 256
    layer = _moe_layer(hidden=hidden, intermediate=256 if bits == 6 else 32)
    for expert in layer.experts:
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(expert, name).weight.detach()
            if bits == 6:
                codes = group_quantized(quantize_q6_k(weight.numpy()), GGMLQuantizationType.Q6_K, weight.shape)
                setattr(expert, name, NativeQ8Linear(codes, None))
                continue
            codes = GroupQuantized.round_to_nearest(weight, bits=4 if bits == 4 else 8, group=32)
            if bits == 5:       # 5-bit codes (Q5_0's): held and multiplied by the 5-bit kernel
                codes = GroupQuantized(codes.codes.clamp(-16, 15), codes.scale, None, 32, 8)
            setattr(expert, name, Int4Linear(codes, None, native=True) if bits == 4 else NativeQ8Linear(codes, None))
    if bits in (5, 6):
        assert layer.experts[0].down_proj.code_bits == bits
    x = torch.randn(350, hidden)    # 1,050 pairs: one call per expert
    per_expert = layer(x[:29])
    assert layer.use_native_kernels() and layer.native and len(layer.experts) == 0
    full = layer(x)
    # float rounding apart (its router's dot products and its SiLU are its own), ~1e-5 of the output a
    # 64-wide row, more over 256
    torch.testing.assert_close(full[:29], per_expert, rtol=1e-5 if hidden == 64 else 1e-4,
                               atol=1e-5 if hidden == 64 else 1e-4)
    for rows in ([0], [7], [3, 4, 5], list(range(1, 29, 2)), list(range(28, -1, -3)), list(range(340))):
        assert torch.equal(layer(x[rows]), full[rows]), rows


def test_experts_off_kvflows_kernels_stay_modules():
    """Float experts (no native codes) are not stacked: the layer keeps its modules and the Python grouping."""
    layer = _moe_layer()
    assert not layer.use_native_kernels() and not layer.native and len(layer.experts) == 8


# ---- GGUF -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family,ftype", [("qwen3_moe", "f16"), ("olmoe", "q8_0"), ("granitemoe", "f32"),
                                          ("mixtral", "f32")])
def test_gguf_twin_gives_the_safetensors_tokens(moe_dirs, tmp_path, family, ftype):
    """The same weights as llama.cpp's converter writes them (stacked ffn_*_exps, ffn_gate_inp; Q/K rows permuted for
    Mixtral's `llama` and GraniteMoE): float32 files give transformers' tokens; f16 / Q8_0 ones kvflow's own tokens
    from the HF folder after the same rounding (dtype float32: the file's values)."""
    path = moe_dirs[family]
    gguf_path = write_gguf_from_hf(path, tmp_path / f"{family}-{ftype}.gguf", ftype=ftype)
    a, b = resolve_model_files(path).config, resolve_model_files(gguf_path).config
    fields = ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling", "dense_layers")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    batch = prompts()[:3]
    got = greedy(LLM(str(gguf_path), dtype="float32", max_model_len=128, kv_cache_memory="16MiB"), batch)
    if ftype == "f32":
        hf = hf_model(path)
        for p, a in zip(batch, got):
            assert_greedy_matches(hf, p, a, length=MAX_TOKENS)
    else:
        # the file's own values, written back to an HF folder: kvflow's HF path must give the same tokens
        from kvflow.models.loader import iter_weights
        from safetensors.torch import save_file

        twin = tmp_path / "rounded"
        twin.mkdir()
        for f in path.iterdir():
            if f.suffix != ".safetensors":
                (twin / f.name).write_bytes(f.read_bytes())
        tensors = {n if n.startswith(("model.", "lm_head")) else n: t.contiguous()
                   for n, t in iter_weights(gguf_path)}
        save_file(tensors, str(twin / "model.safetensors"))
        hf = hf_model(twin)
        for p, a in zip(batch, got):
            assert_greedy_matches(hf, p, a, length=MAX_TOKENS)


def test_unsupported_moe_variants_are_refused_at_load(tmp_path):
    """Refused when the config is read, before any weight: the error names what kvflow lacks."""
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16}
    for extra, error in (({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size.*shared experts"),
                         ({"quantization_config": {"quant_method": "mxfp4"}}, "'mxfp4'.*not supported"),
                         ({"num_experts_per_tok": 9}, "num_experts_per_tok")):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**base, **extra}))
        with pytest.raises(ValueError, match=error):
            LLM(str(folder), dtype="float32")


def _gguf_with_experts(path, qtype_name: str = "F32", **metadata):
    """A header-only-sized qwen3moe GGUF: the metadata and one layer's expert tensors (zeros)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in {"block_count": 1, "embedding_length": 32, "feed_forward_length": 64, "expert_count": 4,
                       "expert_used_count": 2, "attention.head_count": 2, "context_length": 64,
                       "vocab_size": 64, **metadata}.items():
        add = w.add_uint32 if isinstance(value, int) else w.add_string
        add(f"qwen3moe.{key}", value)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    for name, shape in (("ffn_gate_exps", (4, 16, 32)), ("ffn_up_exps", (4, 16, 32)), ("ffn_down_exps", (4, 32, 16))):
        raw = np.zeros((*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
        w.add_tensor(f"blk.0.{name}.weight", raw, raw_dtype=qtype)
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_experts_are_refused_at_load(tmp_path):
    for name, kwargs, error in (
            ("sigmoid", {"expert_gating_func": 2}, "gating function 'sigmoid'"),
            ("shared", {"expert_shared_count": 1}, "shared experts"),
            ("mxfp4", {"qtype_name": "MXFP4"}, "ffn_gate_exps.weight is MXFP4, a format kvflow does not read")):
        path = _gguf_with_experts(tmp_path / f"{name}.gguf", **kwargs)
        with pytest.raises(ValueError, match=error):
            resolve_model_files(path)


def test_stacked_expert_slices_keep_the_files_codes(tmp_path):
    """Each expert's slice of a stacked quantized tensor is a matrix in the file's format: its codes dequantize to
    gguf's own values of that expert, bit for bit (Q4_0, Q8_0, Q4_K, Q6_K kept as codes; Q5_K re-rounded to 8-bit
    codes as its 2-D matrices are)."""
    import numpy as np

    from kvflow.kernels.group_quant import GroupQuantized
    from kvflow.models.gguf_reader import dequantize, read_gguf
    from kvflow.models.loader import _gguf_experts

    path = make_tiny_hf_model(tmp_path / "hf", family="olmoe", seed=4, hidden_size=256, intermediate_size=256,
                              num_hidden_layers=1)
    for ftype, exact in (("q4_0", True), ("q8_0", True), ("q4_k", True), ("q5_k", False), ("q6_k", True)):
        g = read_gguf(write_gguf_from_hf(path, tmp_path / f"{ftype}.gguf", ftype=ftype))
        info = g.tensors["blk.0.ffn_up_exps.weight"]
        assert len(info.shape) == 3 and info.shape[0] == 8
        whole = torch.from_numpy(np.ascontiguousarray(dequantize(g.raw(info), info.qtype, info.shape)))
        pieces = [p.resolve() for p in _gguf_experts(g, info, keep_quantized=True)]      # each read on its own
        assert len(pieces) == 8 and all(isinstance(p, GroupQuantized) for p in pieces)
        for e, piece in enumerate(pieces):
            assert piece.exact == exact
            if exact:
                assert torch.equal(piece.dequantize(), whole[e]), (ftype, e)
            else:
                torch.testing.assert_close(piece.dequantize(), whole[e], rtol=0, atol=whole[e].abs().max() / 100)


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["q4_0", "q4_k", "q6_k", "q8_0"])
def test_quantized_gguf_default_config_serves_the_files_codes_batch_invariant(tmp_path, ftype):
    """A quantized MoE GGUF at the default dtype keeps its codes (the experts on kvflow's kernels where they run),
    and a mixed batch gives each request its tokens alone."""
    from kvflow.layers.int4 import Int4Linear
    from kvflow.layers.quantization import QuantizedLinear

    path = make_tiny_hf_model(tmp_path / "hf", family="qwen3_moe", seed=6, hidden_size=256,
                              moe_intermediate_size=256)
    gguf_path = write_gguf_from_hf(path, tmp_path / f"m-{ftype}.gguf", ftype=ftype)
    llm = LLM(str(gguf_path), max_model_len=128, kv_cache_memory="16MiB")
    assert llm.engine.runner.quantization == "gguf"
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert len(layers) == 2
    if build.usable():      # stacked: one native call per layer
        assert all(m.native and m.gate_up_codes.shape[0] == 8 for m in layers)
    else:
        experts = [e for m in layers for e in m.experts]
        assert len(experts) == 16
        # without kvflow's kernels: 4-bit codes on torch's int4 kernel, 6- and 8-bit ones as per-channel int8
        assert all(isinstance(e.gate_up_proj, Int4Linear if ftype.startswith("q4") else QuantizedLinear)
                   for e in experts)
    batch = prompts()
    together = greedy(llm, batch, 10)
    if build.usable():
        assert together == [greedy(llm, [p], 10)[0] for p in batch]


@pytest.mark.slow
@pytest.mark.skipif(not build.usable(), reason="kvflow's kernels do not run here")
def test_compiled_decode_steps_of_a_quantized_moe_give_the_eager_tokens(tmp_path, monkeypatch):
    """With every expert in one native call per layer, the model's decode steps compile (the grouping by expert is
    inside the call) and give the eager steps' greedy tokens, batched and alone. (The native decoder step, which
    serves such a model by default, is off here: where it does not build, the compiled steps serve.)"""
    monkeypatch.setenv("KVFLOW_NATIVE_STEP", "0")
    path = make_tiny_hf_model(tmp_path / "hf", family="qwen3_moe", seed=8, hidden_size=256,
                              moe_intermediate_size=256)
    gguf_path = write_gguf_from_hf(path, tmp_path / "m-q4_k.gguf", ftype="q4_k")
    settings = dict(max_model_len=128, kv_cache_memory="16MiB", compile_batch_sizes=(1, 4))
    eager = greedy(LLM(str(gguf_path), enforce_eager=True, **settings), prompts(), 12)
    llm = LLM(str(gguf_path), enforce_eager=False, **settings)
    compiled = llm.engine.runner.compiled_decode
    assert compiled is not None and compiled.wait(timeout=600) and not compiled.failed
    assert greedy(llm, prompts(), 12) == eager
    assert greedy(llm, prompts()[1:2], 12) == eager[1:2]
    assert compiled.steps > 0


# ---- through the server and run-batch ----------------------------------------------------------------------------

@pytest.mark.slow
def test_serve_and_run_batch_answer_as_the_offline_engine(moe_dirs, tmp_path):
    """`kvflow serve` (the openai client, streamed and not) and `kvflow run-batch` give a MoE model's greedy text as
    `LLM` does offline."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import openai

    from kvflow.config import EngineConfig
    from kvflow.server.testing import ServerThread

    path = moe_dirs["granitemoe"]
    questions = ["Say alpha", "Name seven apples", "Count: 3 5"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="16MiB")
    offline = [llm.chat([{"role": "user", "content": q}], params)[0].outputs[0].text for q in questions]
    del llm
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=128, kv_cache_memory="16MiB",
                          served_model_name="moe")
    with ServerThread(config) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
        for q, want in zip(questions, offline):
            body = dict(model="moe", messages=[{"role": "user", "content": q}], max_tokens=8, temperature=0,
                        extra_body={"ignore_eos": True})
            assert client.chat.completions.create(**body).choices[0].message.content == want
            streamed = "".join(c.choices[0].delta.content or "" for c in
                               client.chat.completions.create(**body, stream=True) if c.choices)
            assert streamed == want
        server.wait_idle()
        server.core("check")

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                       "body": {"model": "moe", "messages": [{"role": "user", "content": q}],
                                                "max_tokens": 8, "temperature": 0, "ignore_eos": True}}) + "\n"
                           for i, q in enumerate(questions)))
    repo = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "kvflow.cli", "run-batch", "-i", str(inp), "-o", str(out), str(path),
                          "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "16MiB",
                          "--served-model-name", "moe", "--no-progress"], capture_output=True, text=True,
                         timeout=600, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    assert run.returncode == 0, run.stderr[-3000:]
    answers = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
               for r in map(json.loads, out.read_text().splitlines())}
    assert [answers[f"q{i}"] for i in range(len(questions))] == offline


@pytest.mark.slow
@pytest.mark.parametrize("family", ["granitemoe", "qwen3_moe"])
def test_the_benchmarks_random_moe_gguf_loads_and_serves(tmp_path, family):
    """benchmarks/make_moe_gguf.py's file (tiny shape here; Granite 3.1 1B-A400M's for the speed table): the
    metadata reads back as the config it was written from, and the quantized file serves batch invariant."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "make_moe_gguf", Path(__file__).resolve().parents[1] / "benchmarks" / "make_moe_gguf.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    assert make.model_config("granite-1b-a400m", "granitemoe")["num_local_experts"] == 32
    path = make.write(tmp_path / f"{family}.gguf", shape="tiny", family=family, ftype="q8_0")
    cfg = resolve_model_files(path).config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        make.ARCHITECTURES[family], 8, 2, 256)
    llm = LLM(str(path), max_model_len=128, kv_cache_memory="16MiB")
    batch = prompts()
    together = greedy(llm, batch, 6)
    assert all(len(t) == 6 for t in together)
    if build.usable():
        assert together == [greedy(llm, [p], 6)[0] for p in batch]


def test_lora_on_a_moe_model_is_refused(tmp_path):
    path = make_tiny_hf_model(tmp_path, family="mixtral", seed=1, num_hidden_layers=1)
    with pytest.raises(ValueError, match="LoRA is not supported for mixture-of-experts models"):
        LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="4MiB", enable_lora=True)
