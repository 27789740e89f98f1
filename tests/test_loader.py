"""Loader: ModelConfig and HF-named weights from safetensors folders and GGUF files."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow.models.loader import default_model_path, iter_weights, resolve_model_files, unpermute_qk
from kvflow.models.model_files import locate_model
from tiny_models import llama_permute, make_tiny_hf_model, write_gguf_from_hf

FAMILY_OVERRIDES = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 32}}  # qwen3: head_dim != hidden/heads


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (HF folder, its f32 GGUF), made on first use."""
    made = {}

    def get(family):
        if family not in made:
            root = tmp_path_factory.mktemp(f"tiny_{family}")
            hf = make_tiny_hf_model(root / "hf", family, seed=1, **FAMILY_OVERRIDES[family])
            made[family] = hf, write_gguf_from_hf(hf, root / "model-f32.gguf")
        return made[family]
    return get


# --------------------------------------------------------------------------- embedded model

def test_default_model_path_is_embedded_gguf(smollm2_path):
    assert smollm2_path.is_file() and smollm2_path.suffix == ".gguf"
    assert locate_model(None) == smollm2_path == default_model_path()
    assert locate_model(str(smollm2_path.parent)) == smollm2_path  # folder holding one .gguf


def test_embedded_model_config(smollm2_path):
    cfg = resolve_model_files(smollm2_path).config
    assert (cfg.family, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (1536, 49152, 8192)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.rope_scaling is None
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


@pytest.mark.slow
def test_embedded_model_weights_names_and_shapes(smollm2_path):
    weights = dict(iter_weights(smollm2_path))
    assert len(weights) == 2 + 30 * 9 and "lm_head.weight" not in weights
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert weights["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert weights["model.norm.weight"].shape == (576,)
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.slow
def test_embedded_weights_match_transformers_gguf_load(smollm2_path, hf_smol):
    """transformers dequantizes and un-permutes the same file; our tensors must match its parameters."""
    ref_params = {name: p.cpu() for name, p in hf_smol.named_parameters()}
    wanted = {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
              "model.layers.29.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
              "model.layers.7.mlp.down_proj.weight", "model.layers.7.input_layernorm.weight"}
    seen = set()
    for name, w in iter_weights(smollm2_path):
        if name in wanted:
            torch.testing.assert_close(w, ref_params[name].detach(), rtol=0, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == wanted


# --------------------------------------------------------------------------- safetensors vs GGUF

@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_hf_and_gguf_give_same_config_and_tensors(tiny, family):
    hf_dir, gguf_path = tiny(family)
    cfg = resolve_model_files(hf_dir).config
    assert resolve_model_files(gguf_path).config == cfg
    assert cfg.family == family and cfg.num_hidden_layers == 2 and cfg.vocab_size == 49152
    assert cfg.head_dim == (32 if family == "qwen3" else 16)
    assert cfg.attention_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    assert cfg.tie_word_embeddings == (family == "llama")
    hf = dict(iter_weights(hf_dir))
    gg = dict(iter_weights(gguf_path))
    assert sorted(hf) == sorted(gg)
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in gg
    if family == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in gg and "lm_head.weight" in gg
    for name in hf:
        assert gg[name].shape == hf[name].shape, name
        assert torch.equal(gg[name], hf[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("ftype,tol", [("f16", 1e-3), ("bf16", 8e-3), ("q8_0", 1 / 200), ("q4_0", 1 / 7),
                                       ("q4_1", 1 / 14)])
def test_quantized_gguf_loads_close_to_original(tiny, tmp_path, ftype, tol):
    hf_dir, _ = tiny("llama")
    quant = write_gguf_from_hf(hf_dir, tmp_path / f"model-{ftype}.gguf", ftype=ftype)
    hf = dict(iter_weights(hf_dir))
    gg = dict(iter_weights(quant))
    assert sorted(hf) == sorted(gg)
    for name, ref in hf.items():
        got = gg[name]
        assert got.dtype == torch.float32 and got.shape == ref.shape
        err = (got - ref).abs().max().item()
        assert err <= tol * ref.abs().max().item(), (name, err)
        if ref.ndim == 2:  # the Q/K un-permutation must hold through quantization: rows stay correlated
            corr = torch.corrcoef(torch.stack([got.flatten(), ref.flatten()]))[0, 1]
            assert corr > (0.99 if ftype.startswith("q4") else 0.9999), name


def test_sharded_safetensors_folder(tiny, tmp_path):
    hf_dir, _ = tiny("llama")
    tensors = load_file(str(hf_dir / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((hf_dir / "config.json").read_text())
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in files.items():
        save_file({k: tensors[k] for k in keys}, str(out / fname))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in files.items() for k in ks}}))
    loaded = dict(iter_weights(out))
    assert sorted(loaded) == names
    assert all(torch.equal(loaded[k], tensors[k]) for k in names)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    for n_head in (1, 3):
        permuted = torch.from_numpy(llama_permute(w, n_head).copy())
        assert not torch.equal(permuted, torch.from_numpy(w))
        assert torch.equal(unpermute_qk(permuted, n_head), torch.from_numpy(w))
    b = np.arange(24, dtype=np.float32)  # biases are permuted the same way
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_permute(b, 3).copy()), 3), torch.from_numpy(b))


# --------------------------------------------------------------------------- errors

def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    for fn in (locate_model, resolve_model_files, iter_weights):
        with pytest.raises(FileNotFoundError, match="no-such-model.gguf"):
            fn(str(missing) if fn is locate_model else missing)


def test_corrupt_gguf_is_value_error_naming_path(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="corrupt.gguf"):
        resolve_model_files(bad).config
    with pytest.raises(ValueError, match="corrupt.gguf"):
        iter_weights(bad)


def test_truncated_gguf_is_value_error(tiny, tmp_path):
    _, gguf_path = tiny("llama")
    data = gguf_path.read_bytes()
    for cut in (len(data) // 2, 100_000, 1000):
        short = tmp_path / f"truncated-{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=short.name):
            list(iter_weights(short))


def test_unsupported_hf_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "n_layer": 2, "vocab_size": 10}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
        resolve_model_files(tmp_path).config
    assert "LlamaForCausalLM" in str(e.value) and "Qwen3ForCausalLM" in str(e.value)


def test_unsupported_gguf_architecture_lists_supported(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gpt2") as e:
        resolve_model_files(path).config
    assert "llama" in str(e.value) and "qwen3" in str(e.value)


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_files(tmp_path).config
    with pytest.raises(ValueError, match="safetensors"):
        list(iter_weights(tmp_path))


# --------------------------------------------------------------------------- ModelFiles: resolved once

@pytest.mark.slow
def test_model_files_parse_the_gguf_once(smollm2_path, monkeypatch):
    import kvflow.models.model_files as model_files
    from kvflow.tokenizer import Tokenizer

    reads = []
    real = model_files.read_gguf
    monkeypatch.setattr(model_files, "read_gguf", lambda p: reads.append(p) or real(p))
    files = resolve_model_files(None)
    assert reads == [smollm2_path]
    assert (files.path, files.format, files.hf_config) == (smollm2_path, "gguf", None)
    assert files.config == resolve_model_files(smollm2_path).config
    assert files.tokenizer_path == smollm2_path and files.tokenizer_gguf is files.gguf
    assert resolve_model_files(str(smollm2_path.parent)).path == smollm2_path     # folder holding one .gguf
    tok = Tokenizer.from_files(files)
    assert tok.encode("Hello") == Tokenizer.from_model(smollm2_path).encode("Hello")
    names = [n for n, _ in iter_weights(files)]
    assert len(names) == 2 + 30 * 9


@pytest.mark.slow
def test_model_files_of_an_hf_folder(tiny):
    from kvflow.tokenizer import Tokenizer

    hf_dir, gguf_path = tiny("qwen2")
    files = resolve_model_files(hf_dir)
    assert files.format == "hf" and files.gguf is None and files.hf_config["architectures"] == ["Qwen2ForCausalLM"]
    assert files.config == resolve_model_files(hf_dir).config and files.tokenizer_path == hf_dir
    assert sorted(n for n, _ in iter_weights(files)) == sorted(n for n, _ in iter_weights(hf_dir))
    assert Tokenizer.from_files(files).vocab_size > 0
    other = resolve_model_files(hf_dir, tokenizer=gguf_path)               # a tokenizer from elsewhere
    assert other.tokenizer_path == gguf_path and other.tokenizer_gguf.path == gguf_path


def test_model_files_errors_name_the_path(tmp_path):

    with pytest.raises(FileNotFoundError, match="nothing-here"):
        resolve_model_files(tmp_path / "nothing-here")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_files(tmp_path)
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ValueError, match="corrupt.gguf"):
        resolve_model_files(bad)
