"""ModelConfig: the architecture numbers a model needs, read from config.json, or from GGUF metadata turned into
the config.json it stands for (`model_files.gguf_model_config`): one builder for both formats."""
from __future__ import annotations

from dataclasses import dataclass, field

# config.json `architectures[0]` -> our family name
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# GGUF `general.architecture` -> the config.json architecture it stands for
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}
# GGUF metadata `{arch}.{key}` -> the config.json key it stands for
GGUF_CONFIG_KEYS = {
    "vocab_size": "vocab_size", "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
}


@dataclass(frozen=True)
class ModelConfig:
    family: str                       # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's rope_scaling dict (llama3 type supported)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False             # RMSNorm on per-head q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @staticmethod
    def from_hf_dict(cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        family = SUPPORTED_ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers 5 folds theta and scaling in here
        if rope_params:
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default" and rope_scaling is None:
                rope_scaling = dict(rope_params)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("default", None):
            rope_scaling = None
        return ModelConfig(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
