"""Tiny random-weight models for tests: an HF folder (safetensors + SmolLM2 tokenizer) and its GGUF twin.

`make_tiny_hf_model` saves a real transformers model; `write_gguf_from_hf` writes the same weights as
llama.cpp's convert_hf_to_gguf.py would (GGUF names, reversed shapes, llama Q/K rows permuted,
architecture and tokenizer metadata), optionally quantized with gguf.quants.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
}
# each mixture of experts' small shape: 8 experts, 2 or 3 per token (overrides change them)
MOE_SHAPES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, head_dim=16,
                      norm_topk_prob=True, use_sliding_window=False),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, embedding_multiplier=12.0,
                       residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=6.0),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
}
# hybrids' small shapes (recurrent layers between attention layers)
HYBRID_SHAPES = {
    # Granite 4.0 H 350M / 1B, small: Mamba2 layers (8 heads x 16 = 2 x hidden, 2 groups of B/C so the grouping
    # shows, conv 4 with bias) with NoPE attention at 2 and 5, the dense shared MLP (no experts; `intermediate_size`,
    # which only the experts would read, differs so that a mix-up shows), Granite's multipliers; the real configs'
    # layer spelling ("mamba" / "attention")
    "granitemoehybrid": dict(num_hidden_layers=6, num_local_experts=0, shared_intermediate_size=128,
                             intermediate_size=32, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                             mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
                             position_embedding_type="nope", embedding_multiplier=12.0, residual_multiplier=0.22,
                             attention_multiplier=0.0625, logits_scaling=6.0,
                             layer_types=["mamba", "mamba", "attention", "mamba", "mamba", "attention"]),
    # LFM2-350M's layout, small: gated short convolutions (L 3) with attention at 2 and 5; tied; MLP width 96
    # (128 adjusted: int(2 * 128 / 3) = 85, rounded up to a multiple of 32)
    "lfm2": dict(num_hidden_layers=6, layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
                 conv_L_cache=3, block_multiple_of=32, rope_theta=1_000_000.0, tie_word_embeddings=True),
}
SMOLLM2_VOCAB = 49152
# the random matrices' scale (the embedding's stays 0.05) where 0.05 leaves a family's layers too weak to move greedy
# tokens off the prompt's last one (tied embeddings): LFM2's gated convolutions multiply three small projections;
# SmolLM3's 4 tied layers repeat one token at 0.05, where a NoPE layer and a RoPE one give the same tokens
MATRIX_STD = {"lfm2": 0.1, "smollm3": 0.1}


def make_tiny_hf_model(out_dir: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """A complete HF model folder (config.json, model.safetensors float32, tokenizer, chat template). `matrix_std`
    (an override): the random matrices' scale instead of the family's (MATRIX_STD). Qwen3.5 with
    `mtp_num_hidden_layers=1`: a random multi-token-prediction block too (`mtp.*`, as the released checkpoints hold
    it; transformers ignores it)."""
    import transformers

    from kvflow.models.loader import default_model_path
    from kvflow.tokenizer import Tokenizer

    out_dir = Path(out_dir)
    cfg_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    kwargs = dict(
        vocab_size=SMOLLM2_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=(family == "llama"), bos_token_id=1, eos_token_id=2,
        pad_token_id=2, torch_dtype="float32",
    )
    if family in ("qwen2", "qwen3"):
        kwargs.update(head_dim=16, use_sliding_window=False)
    kwargs.update(MOE_SHAPES.get(family, {}))
    kwargs.update(HYBRID_SHAPES.get(family, {}))
    if family == "lfm2":        # Lfm2Config names it norm_eps
        kwargs["norm_eps"] = kwargs.pop("rms_norm_eps")
    if family == "gemma3":      # Gemma 3 270M's shape, small: head_dim 256, 1 KV head, 5 local : 1 global
        kwargs.update(num_hidden_layers=6, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                      sliding_window=16, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True)
    if family == "smollm3":     # SmolLM3-3B's layout, small: a NoPE layer every 4th (layer 3 of 4), theta 2M, tied
        kwargs.update(num_hidden_layers=4, no_rope_layer_interval=4, rope_theta=2_000_000.0, tie_word_embeddings=True)
    if family == "qwen3_5":     # Qwen3.5's layout, small: 3 Gated DeltaNet layers : 1 gated attention, twice;
        # partial RoPE; twice as many value heads as key heads in the Gated DeltaNet (its grouped heads)
        kwargs.update(num_hidden_layers=8, head_dim=32, partial_rotary_factor=0.25, full_attention_interval=4,
                      linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    matrix_std = overrides.pop("matrix_std", MATRIX_STD.get(family, 0.05))
    mtp_layers = overrides.pop("mtp_num_hidden_layers", 0) if family == "qwen3_5" else 0
    kwargs.update(overrides)
    hf_dtype = kwargs.pop("torch_dtype")
    config = cfg_cls(**kwargs)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls.__name__)(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # give every tensor distinct random values (norms near 1) so mix-ups show
        for name, p in model.named_parameters():
            if family == "qwen3_5" and name.endswith("norm.weight") and ".linear_attn." not in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))      # zero-centred: the norm multiplies by 1 + w
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("linear_attn.A_log"):    # decay rates from ~0.02 (long memory) to ~4 per unit of dt
                p.copy_(torch.empty(p.shape).uniform_(-4.0, 1.4, generator=gen))
            elif name.endswith("linear_attn.dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) - 1.0)
            elif name.endswith("linear_attn.conv1d.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("mlp.gate.weight", "router.weight", "gate.weight")):
                # routers wide apart enough that a routing mistake changes the tokens
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mamba.dt_bias"):
                # softplus(-4) ~ 0.02: each token's decay exp(dt A) stays near 1, so the state carries far (as
                # trained Mamba2 layers' small steps do)
                p.copy_(-4.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mamba.A_log"):
                p.copy_(torch.log(1.0 + 7.0 * torch.rand(p.shape, generator=gen)))      # A in -8 .. -1
            else:
                std = 0.05 if "embed" in name else matrix_std
                p.copy_(std * torch.randn(p.shape, generator=gen))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.torch_dtype = hf_dtype
    model.save_pretrained(out_dir)
    if family == "granitemoehybrid":        # the released configs' spelling, which transformers 5 saves renamed
        cfg_file = out_dir / "config.json"
        cfg = json.loads(cfg_file.read_text())
        legacy = {"linear_attention": "mamba", "full_attention": "attention"}
        cfg["layer_types"] = [legacy.get(t, t) for t in cfg["layer_types"]]
        cfg_file.write_text(json.dumps(cfg, indent=2))
    if mtp_layers:
        _add_qwen3_5_mtp(out_dir, mtp_layers, matrix_std, gen)
    Tokenizer.from_model(default_model_path()).hf.save_pretrained(out_dir)
    return out_dir


def _add_qwen3_5_mtp(out_dir: Path, layers: int, matrix_std: float, gen: torch.Generator) -> None:
    """Qwen3.5's MTP block as the checkpoints hold it, random: fc [hidden, 2 hidden], its three zero-centred norms,
    and `layers` full-attention decoder layers shaped as the trunk's (its first full-attention layer's names)."""
    from safetensors.torch import load_file, save_file

    cfg_file = out_dir / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["mtp_num_hidden_layers"] = layers
    cfg_file.write_text(json.dumps(cfg, indent=2))
    tensors = load_file(out_dir / "model.safetensors")
    full = cfg["layer_types"].index("full_attention")
    hidden = cfg["hidden_size"]
    shapes = {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
              "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)}
    for i in range(layers):
        shapes.update({name.replace(f"model.layers.{full}.", f"mtp.layers.{i}."): tuple(t.shape)
                       for name, t in tensors.items() if name.startswith(f"model.layers.{full}.")})
    for name, shape in shapes.items():
        std = 0.1 if name.endswith("norm.weight") else matrix_std      # norms zero-centred: 1 + w
        tensors[name] = std * torch.randn(shape, generator=gen)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})


# --------------------------------------------------------------------------- GGUF

_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
# llama.cpp's converters that permute Q/K rows (not LFM2's)
_PERMUTED = ("llama", "granitemoe", "granitehybrid", "smollm3")


# llama.cpp's names where an architecture's differ from the llama table
_ARCH_GGUF_BLOCK = {
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "gemma3": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "granitehybrid": {"mamba.in_proj": "ssm_in", "mamba.conv1d": "ssm_conv1d", "mamba.norm": "ssm_norm",
                      "mamba.out_proj": "ssm_out", "shared_mlp.gate_proj": "ffn_gate", "shared_mlp.up_proj": "ffn_up",
                      "shared_mlp.output_linear": "ffn_down"},
    "lfm2": {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.out_proj": "attn_output",
             "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
             "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
             "conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj"},
}
# tensors named whole (no .weight / .bias of their own): Mamba2's, as llama.cpp's conversion/mamba.py writes them
_WHOLE_GGUF_NAMES = {"mamba.A_log": "ssm_a", "mamba.D": "ssm_d", "mamba.dt_bias": "ssm_dt.bias"}
# kept float32 in a quantized file, as llama.cpp's converter keeps them (the conv taps are 3 or 4 wide: no blocks)
_F32_ALWAYS = ("ssm_conv1d", "ssm_norm", "ssm_a", "ssm_d", "shortconv.conv")


def _kept_f32(gname: str) -> bool:
    """A block tensor llama.cpp never quantizes, by its name after blk.N. (Qwen3.5's ssm_alpha is quantized)."""
    rest = gname.split(".", 2)[2] if gname.startswith("blk.") else ""
    return any(rest == p or rest.startswith(p + ".") for p in _F32_ALWAYS)


def hf_name_to_gguf(name: str, arch: str = "llama") -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight",
           "model.embedding_norm.weight": "token_embd_norm.weight"}      # LFM2's final norm, as llama.cpp names it
    if name in top:
        return top[name]
    parts = name.split(".")  # model.layers.N.<module...>.<weight|bias>
    assert parts[:2] == ["model", "layers"], name
    if ".".join(parts[3:]) in _WHOLE_GGUF_NAMES:
        return f"blk.{parts[2]}.{_WHOLE_GGUF_NAMES['.'.join(parts[3:])]}"
    module = ".".join(parts[3:-1])
    piece = _ARCH_GGUF_BLOCK.get(arch, {}).get(module) or _HF_TO_GGUF_BLOCK[module]
    return f"blk.{parts[2]}.{piece}.{parts[-1]}"


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tokenizer_metadata(hf_dir: Path) -> dict:
    """What llama.cpp's gpt2-style vocab conversion reads from tokenizer.json / tokenizer_config.json."""
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tj["model"]["vocab"])
    added = {t["content"]: t for t in tj.get("added_tokens", [])}
    for content, t in added.items():
        vocab[content] = t["id"]
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [1] * n  # NORMAL
    for tok, i in vocab.items():
        tokens[i] = tok
        if tok in added:
            types[i] = 3 if added[tok].get("special") else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    tc_file = hf_dir / "tokenizer_config.json"
    tc = json.loads(tc_file.read_text()) if tc_file.exists() else {}
    template = tc.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").exists():
        template = (hf_dir / "chat_template.jinja").read_text()

    def tid(name):
        tok = tc.get(name)
        if isinstance(tok, dict):
            tok = tok.get("content")
        return vocab.get(tok) if tok is not None else None

    return dict(tokens=tokens, types=types, merges=merges, template=template,
                bos=tid("bos_token"), eos=tid("eos_token"), unk=tid("unk_token"), pad=tid("pad_token"),
                add_bos=bool(tc.get("add_bos_token", False)))


_FTYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q4_k": 14, "q4_k_m": 15,
           "q5_k": 17, "q6_k": 18, "bf16": 32}  # llama_ftype values


def _k_scales_mins(sub: np.ndarray, levels: int) -> tuple:
    """Q4_K / Q5_K's two-level scales for sub-blocks [blocks, 8, 32]: fp16 d and dmin per block, 6-bit sc and m
    per sub-block, and the codes 0..levels of value d * sc * q - dmin * m (round to nearest, no search)."""
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / levels
    d = np.maximum(scale.max(-1), 1e-12) / 63.0
    dmin = np.maximum(-lo.min(-1), 1e-12) / 63.0
    d, dmin = d.astype(np.float16), dmin.astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale / d32), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / dmin32), 0, 63).astype(np.uint8)
    step = (d32 * sc)[..., None]
    q = np.clip(np.round((sub + (dmin32 * m)[..., None]) / step), 0, levels).astype(np.uint8)
    packed = np.empty((sub.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    head = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed], axis=1)
    return head, q


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes [blocks, 8, 32] -> Q4_K / Q5_K's 128 bytes: bytes 32c..32c+31 hold sub-block 2c low, 2c + 1 high."""
    qs = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, K] float32 (K a multiple of 256) -> GGUF Q4_K blocks [rows, K / 256 * 144] uint8, which gguf-py
    cannot write: per block of 256, fp16 d and dmin, 6-bit scales and mins of its 8 sub-blocks of 32 (packed as
    ggml's get_scale_min_k4 reads them), then 4-bit codes (bytes 32c..32c+31: sub-block 2c low, 2c + 1 high);
    value = d * sc * q - dmin * m. Round to nearest, no search: a valid file, not llama.cpp's best rounding."""
    rows, k = x.shape
    head, q = _k_scales_mins(x.astype(np.float32).reshape(-1, 8, 32), 15)
    return np.concatenate([head, _low_nibbles(q)], axis=1).reshape(rows, k // 256 * 144)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """As `quantize_q4_k` with 5-bit codes (0..31): d, dmin, the 12 scale bytes, then qh [32] (bit j of byte i:
    the high bit of sub-block j's element i) and the 128 bytes of low nibbles. [rows, K / 256 * 176]."""
    rows, k = x.shape
    head, q = _k_scales_mins(x.astype(np.float32).reshape(-1, 8, 32), 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)     # [blocks, 32]
    return np.concatenate([head, qh, _low_nibbles(q)], axis=1).reshape(rows, k // 256 * 176)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[rows, K] float32 (K a multiple of 256) -> GGUF Q6_K blocks [rows, K / 256 * 210]: per block of 256, ql [128]
    (low 4 bits), qh [64] (high 2 bits), 16 int8 scales (one per 16 values), fp16 d; value = d * scale * (q - 32),
    q 0..63, laid out as ggml's dequantize_row_q6_K reads them. Round to nearest."""
    rows, k = x.shape
    g = x.astype(np.float32).reshape(-1, 16, 16)                          # [blocks, group of 16, 16]
    pos = np.argmax(np.abs(g), -1)
    peak = np.take_along_axis(g, pos[..., None], -1)[..., 0]               # the signed value of largest size
    scale = peak / -32.0
    top = np.take_along_axis(scale, np.argmax(np.abs(scale), -1)[:, None], -1)[:, 0]
    d = (top / -128.0).astype(np.float16)
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[:, None] != 0, np.round(scale / d32[:, None]), 0)
        sc = np.clip(sc, -128, 127).astype(np.int8)
        step = d32[:, None] * sc.astype(np.float32)
        q = np.where(step[..., None] != 0, np.round(g / step[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)    # [blocks, half, 128]
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)               # [blocks, 2, 64]
    high = (q >> 4).reshape(-1, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)   # [blocks, 2, 32]
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                             d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, k // 256 * 210)


_K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
# llama.cpp's fallback for a matrix whose rows are not a multiple of 256 wide (llama_tensor_get_type)
_K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _q4_k_m_type(gname: str, layers: int) -> str:
    """What llama-quantize's Q4_K_M picks, simplified: Q6_K for the embedding/head and for attn_v / ffn_down of
    the first and last eighth of the layers and every third between, Q4_K elsewhere."""
    if not gname.startswith("blk."):
        return "Q6_K"
    i = int(gname.split(".")[1])
    more_bits = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
    return "Q6_K" if more_bits and (".attn_v." in gname or ".ffn_down" in gname) else "Q4_K"   # ffn_down_exps too


def _stacked_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every family's expert tensors as llama.cpp stacks them: `mlp.experts.{gate,up,down}_proj` [experts, rows,
    columns] per layer, beside the router `mlp.gate` (names as kvflow's loader.canonical_experts gives them)."""
    from kvflow.models.loader import canonical_experts

    out: dict[str, np.ndarray] = {}
    pieces: dict[str, dict[int, np.ndarray]] = {}
    for name, data in canonical_experts(iter(tensors.items())):
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            expert, proj, _ = rest.split(".")
            pieces.setdefault(f"{prefix}.mlp.experts.{proj}.weight", {})[int(expert)] = np.asarray(data)
        else:
            out[name] = data
    for name, by_expert in pieces.items():
        out[name] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def write_gguf_from_hf(hf_dir: Path, out_path: Path, ftype: str = "f32", tensors=None,
                       types: dict[str, str] | None = None) -> Path:
    """Write the HF folder's model as GGUF like llama.cpp's converter. ftype: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1,
    the K-quants q4_k q5_k q6_k (for matrices whose rows are a multiple of 256 wide; q4_k writes the others Q8_0,
    q5_k and q6_k take llama.cpp's fallbacks Q5_1 and Q8_0), or q4_k_m (llama-quantize's mix, `_q4_k_m_type`,
    with its fallbacks: Q4_K -> Q5_0, Q6_K -> Q8_0). `tensors`: (HF name, float32 array) pairs to write instead of
    the folder's safetensors (experts already stacked as `_stacked_experts` gives them), read one at a time: how
    benchmarks/make_moe_gguf.py writes a model too big to hold in float32. `types`: with a K-quant ftype, GGUF tensor
    name -> the K-quant to write it in instead of the ftype's choice (fallbacks as above): e.g. {"token_embd.weight":
    "Q4_K"}, what llama-quantize's Q4_K_M gives an untied model's embedding."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from safetensors.numpy import load_file

    qtypes = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1,
              "q5_0": T.Q5_0, "q5_1": T.Q5_1, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K, "q4_k_m": T.Q4_K}
    qtype = qtypes[ftype]
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
            "Phi3ForCausalLM": "phi3", "Gemma3ForCausalLM": "gemma3", "Qwen3MoeForCausalLM": "qwen3moe",
            "OlmoeForCausalLM": "olmoe", "GraniteMoeForCausalLM": "granitemoe",
            "MixtralForCausalLM": "llama", "Qwen3_5ForCausalLM": "qwen35",
            "GraniteMoeHybridForCausalLM": "granitehybrid", "Lfm2ForCausalLM": "lfm2",
            "SmolLM3ForCausalLM": "smollm3"}[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:        # Gemma 3: per layer type; the file holds the global base (local: 10k)
        rope = rope["full_attention"]
    rope_theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    rotary_dim = int(head_dim * (cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0))

    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_name(hf_dir.name)
    # Qwen3.5's multi-token-prediction layers (`mtp.*` in the folder) follow the trunk's, counted in block_count
    mtp = cfg.get("mtp_num_hidden_layers", 0) if arch == "qwen35" else 0
    w.add_block_count(cfg["num_hidden_layers"] + mtp)
    if mtp:
        w.add_nextn_predict_layers(mtp)
    w.add_context_length(cfg["max_position_embeddings"] if arch != "granitehybrid" else 2 ** 20)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(heads)
    if arch == "granitehybrid":
        w.add_feed_forward_length(cfg["intermediate_size"])
        _granite_hybrid_metadata(w, cfg, kv_heads)
    elif arch == "lfm2":      # llama.cpp's LFM2 converter: the real MLP width, KV heads per layer (0: a convolution)
        from kvflow.models.model_config import ModelConfig

        w.add_feed_forward_length(ModelConfig.from_hf_dict(cfg).intermediate_size)
        w.add_head_count_kv([0 if t == "conv" else kv_heads for t in cfg["layer_types"]])
        w.add_shortconv_l_cache(cfg["conv_L_cache"])
    else:
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps") or cfg["norm_eps"]))
    w.add_rope_dimension_count(rotary_dim)
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if head_dim != cfg["hidden_size"] // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    longrope = rope if rope.get("rope_type") == "longrope" else None
    if longrope:        # as llama.cpp's Phi-3 converter: the original context, the attention factor, two tensors
        original = longrope["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:         # as llama.cpp's MoE converters write them
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if arch == "qwen3moe":
            w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob")))
        if arch == "granitemoe":
            w.add_embedding_scale(cfg["embedding_multiplier"])
            w.add_residual_scale(cfg["residual_multiplier"])
            w.add_attention_scale(cfg["attention_multiplier"])
            w.add_logit_scale(cfg["logits_scaling"])
        if cfg.get("clip_qkv"):
            w.add_clamp_kqv(cfg["clip_qkv"])
    if arch == "qwen35":        # as llama.cpp's Qwen3NextModel / Qwen3_5TextModel write them
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(cfg.get("full_attention_interval")
                                      or cfg["layer_types"].index("full_attention") + 1)
        w.add_rope_dimension_sections([*rope.get("mrope_section", [11, 11, 10]), 0][:4])
    w.add_file_type(_FTYPES[ftype])

    tok = _hf_tokenizer_metadata(hf_dir)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    for adder, key in ((w.add_bos_token_id, "bos"), (w.add_eos_token_id, "eos"),
                       (w.add_unk_token_id, "unk"), (w.add_pad_token_id, "pad")):
        if tok[key] is not None:
            adder(tok[key])
    w.add_add_bos_token(tok["add_bos"])
    if tok["template"]:
        w.add_chat_template(tok["template"])

    if tensors is not None:
        _write_tensors(w, tensors, arch, cfg, ftype, qtype, heads, kv_heads, types)
        return _finish(w, out_path, None)
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    if experts:
        tensors = _stacked_experts(tensors)
    if arch == "qwen35":
        tensors = _qwen35_tensors(tensors, cfg)
    if arch == "granitehybrid":
        tensors = _granite_hybrid_tensors(tensors, cfg)
    _write_tensors(w, tensors.items(), arch, cfg, ftype, qtype, heads, kv_heads, types)
    return _finish(w, out_path, longrope)


def _granite_hybrid_metadata(w, cfg: dict, kv_heads: int) -> None:
    """llama.cpp's granitehybrid keys (conversion/granite.py GraniteHybridModel): KV heads per layer (0: a Mamba2
    layer), the Mamba2 sizes (time_step_rank: the heads), the Granite multipliers, the dense MLP's width as the shared
    expert's (feed_forward_length holds config.json's intermediate_size), RoPE off."""
    types = cfg["layer_types"]
    w.add_head_count_kv([kv_heads if t in ("attention", "full_attention") else 0 for t in types])
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(cfg["mamba_n_groups"])
    w.add_ssm_inner_size(cfg["mamba_expand"] * cfg["hidden_size"])
    w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
    w.add_embedding_scale(cfg["embedding_multiplier"])
    w.add_residual_scale(cfg["residual_multiplier"])
    w.add_attention_scale(cfg["attention_multiplier"])
    w.add_logit_scale(cfg["logits_scaling"])
    w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
    w.add_rope_scaling_finetuned(cfg.get("position_embedding_type") == "rope")


def _granite_hybrid_tensors(tensors: dict[str, np.ndarray], cfg: dict) -> dict[str, np.ndarray]:
    """The HF tensors as llama.cpp's converter reshapes them: the shared MLP's [gate; up] split, the conv taps
    [channels, K], A stored as -exp(A_log) and A, D as (heads, 1), the gated norm as (groups, d_inner / groups)."""
    groups = cfg["mamba_n_groups"]
    out = {}
    for name, data in tensors.items():
        data = np.asarray(data, dtype=np.float32)
        if name.endswith("shared_mlp.input_linear.weight"):
            gate, up = np.split(data, 2, axis=0)
            out[name.replace("input_linear", "gate_proj")] = gate
            out[name.replace("input_linear", "up_proj")] = up
            continue
        if name.endswith("mamba.conv1d.weight"):
            data = data.reshape(data.shape[0], -1)
        elif name.endswith("mamba.A_log"):
            data = (-torch.exp(torch.from_numpy(data))).numpy().reshape(-1, 1)
        elif name.endswith("mamba.D"):
            data = data.reshape(-1, 1)
        elif name.endswith("mamba.norm.weight"):
            data = data.reshape(groups, -1)
        out[name] = data
    return out


def _write_tensors(w, tensors, arch: str, cfg: dict, ftype: str, qtype, heads: int, kv_heads: int,
                   types: dict[str, str] | None = None) -> None:
    import gguf
    from gguf import GGMLQuantizationType as T

    for name, data in tensors:
        data = data.astype(np.float32)
        if arch in _PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = llama_permute(data, heads)
        elif arch in _PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = llama_permute(data, kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0       # llama.cpp's Gemma converter stores the norms as 1 + w
        if name.endswith("conv.conv.weight"):
            data = data.squeeze(1)  # LFM2's depthwise convolution [hidden, 1, L] as [hidden, L], always F32
        gname = name if arch == "qwen35" else hf_name_to_gguf(name, arch)     # (qwen35: named already)
        if data.ndim < 2 or qtype == T.F32 or _kept_f32(gname):
            # norms, biases and the recurrent layers' small tensors stay F32, as llama.cpp keeps them
            w.add_tensor(gname, np.ascontiguousarray(data))
        elif qtype == T.F16:
            w.add_tensor(gname, data.astype(np.float16))
        elif qtype.name in _K_QUANTIZERS:
            kind = _q4_k_m_type(gname, cfg["num_hidden_layers"]) if ftype == "q4_k_m" else qtype.name
            kind = (types or {}).get(gname, kind)
            if data.shape[-1] % 256 == 0:
                rows = _K_QUANTIZERS[kind](data.reshape(-1, data.shape[-1]))
                w.add_tensor(gname, rows.reshape(*data.shape[:-1], -1), raw_dtype=T[kind])
            else:
                fallback = T[_K_FALLBACK[kind]] if ftype != "q4_k" else T.Q8_0
                w.add_tensor(gname, gguf.quants.quantize(data, fallback), raw_dtype=fallback)
        else:
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _qwen35_tensors(tensors: dict[str, np.ndarray], cfg: dict) -> dict[str, np.ndarray]:
    """A Qwen3.5 checkpoint as llama.cpp's converter writes it (conversion/qwen.py: Qwen3NextModel.modify_tensors and
    _LinearAttentionVReorderBase), named by gguf-py's own tensor map: the zero-centred norms as 1 + w (not the Gated
    DeltaNet's gated norm), A_log as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the convolution's taps squeezed to
    [channels, kernel]; with fewer key than value heads, every tensor with a row (column: out_proj) per value head
    reordered from grouped by key head to tiled. MTP tensors (`mtp.*`) as llama.cpp's _Qwen35MtpMixin writes them
    when the config counts them (`mtp_num_hidden_layers`; else left out, as --no-mtp): its decoder layers as blocks
    after the trunk's, fc and its norms as that first block's nextn.* tensors."""
    import gguf

    layers, mtp = cfg["num_hidden_layers"], cfg.get("mtp_num_hidden_layers", 0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, layers + mtp)
    nextn = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
             "norm": "shared_head_norm"}
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]

    def tiled(x: np.ndarray, axis: int, head_dim: int) -> np.ndarray:     # llama.cpp's _reorder_v_heads
        x = np.moveaxis(x, axis, 0)
        shape = x.shape
        x = x.reshape(hk, hv // hk, head_dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
        return np.ascontiguousarray(np.moveaxis(x, 0, axis))

    out = {}
    for name, data in tensors.items():
        data = np.asarray(data, dtype=np.float32)
        if name.startswith("mtp.") and not mtp:
            continue
        if name.startswith("mtp.layers."):
            i, rest = name.removeprefix("mtp.layers.").split(".", 1)
            name = f"model.layers.{layers + int(i)}.{rest}"
        elif name.startswith("mtp."):
            piece, suffix = name.removeprefix("mtp.").rsplit(".", 1)
            out[f"blk.{layers}.nextn.{nextn[piece]}.{suffix}"] = data + 1.0 if "norm" in piece else data
            continue
        if name.endswith(".A_log"):
            data, name = -np.exp(data), name.removesuffix(".A_log") + ".A_log.weight"
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif name.endswith(".conv1d.weight"):
            data = data.squeeze(1)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            data = data + 1.0
        if hk != hv and ".linear_attn." in name:
            qk = 2 * hk * dk
            if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
                data = np.concatenate([data[:qk], tiled(data[qk:], 0, dv)])
            elif name.endswith(".in_proj_z.weight"):
                data = tiled(data, 0, dv)
            elif name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log.weight", ".dt_proj.bias")):
                data = tiled(data, 0, 1)
            elif name.endswith(".out_proj.weight"):
                data = tiled(data, 1, dv)
        base, suffix = name.rsplit(".", 1)
        gname = names.get_name(base)
        assert gname is not None, name
        # ssm_a has no suffix in llama.cpp's files
        out[gname if gname.endswith(".ssm_a") else f"{gname}.{suffix}"] = data
    return out


def _finish(w, out_path: Path, longrope: dict | None) -> Path:
    if longrope:
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(longrope[f"{kind}_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


# a tiny WordPiece vocabulary for the random-weight BERTs: BERT's special tokens, letters (and their ## pieces), words
BERT_WORDS = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdefghijklmnopqrstuvwxyz0123456789.,?!'-")
              + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
              + ("the quick brown fox jumps over lazy dog what is a paris capital of france cats are small animals "
                 "kvflow serves embeddings and reranks documents query relevant answer city river berlin germany "
                 "paged attention keeps cache in blocks").split())


def make_tiny_bert(out_dir: Path, architecture: str = "BertModel", seed: int = 0, pooling: str | None = "mean",
                   normalize: bool = True, max_seq_length: int | None = None, **overrides) -> Path:
    """A random-weight BERT folder (float32 safetensors, a WordPiece tokenizer of BERT_WORDS): `BertModel`, or
    `BertForSequenceClassification` with one label (a cross-encoder). `pooling` ("mean", "cls", "lasttoken"): a
    sentence-transformers layout (modules.json, 1_Pooling/config.json, a Normalize module when `normalize`,
    sentence_bert_config.json with `max_seq_length`); None: a plain transformers folder."""
    import transformers

    out_dir = Path(out_dir)
    kwargs = dict(vocab_size=len(BERT_WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12,
                  hidden_act="gelu")
    if architecture == "BertForSequenceClassification":
        kwargs["num_labels"] = 1
    kwargs.update(overrides)
    config = transformers.BertConfig(**kwargs)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():      # distinct random values everywhere (LayerNorms near 1) so mix-ups show
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_((0.5 if "embeddings" in name else 0.1) * torch.randn(p.shape, generator=gen))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    transformers.BertTokenizer(vocab={w: i for i, w in enumerate(BERT_WORDS)}).save_pretrained(out_dir)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
        (out_dir / "1_Pooling").mkdir(exist_ok=True)
        (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
            "pooling_mode_lasttoken": pooling == "lasttoken"}))
        (out_dir / "sentence_bert_config.json").write_text(json.dumps(
            {"max_seq_length": max_seq_length or kwargs["max_position_embeddings"], "do_lower_case": False}))
    return out_dir
