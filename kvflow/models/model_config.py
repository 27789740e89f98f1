"""ModelConfig: the architecture numbers a model needs, read from config.json, or from GGUF metadata turned into
the config.json it stands for (`model_files.gguf_model_config`): one builder for both formats.

Which architectures kvflow serves is one table, `ARCHITECTURES`: each row names the config.json `architectures`
entry, its `model_type`s, its GGUF `general.architecture`, the model class that runs it and how its config reads.
An architecture that is not in it is one `ValueError` naming it and listing the supported ones; the few that are
known and refused on purpose (`REFUSED`) say why.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Architecture:
    name: str                          # config.json `architectures[0]`
    family: str                        # ModelConfig.family
    model_types: tuple[str, ...]       # config.json `model_type` values that mean this architecture
    gguf: tuple[str, ...]              # GGUF `general.architecture` values
    model_class: str                   # "module:Class" under kvflow.models, imported on use
    attention_bias: bool = False       # q/k/v bias unless config.json says otherwise (Qwen2)
    qk_norm: bool = False              # RMSNorm on per-head q and k (Qwen3, Gemma 3)
    permuted_qk: bool = False          # llama.cpp permutes Q/K rows in its GGUF (llama family)
    sliding_window_everywhere: bool = False   # config `sliding_window` applies to every layer (Mistral, Phi-3)
    # GGUF tensor names (the piece after blk.N.) that differ from the llama table in loader.py
    gguf_tensor_names: tuple[tuple[str, str], ...] = ()
    # for a tokenizer that carries none (llama.cpp's Gemma 3 GGUFs have no tokenizer.chat_template): the family's own
    chat_template: str | None = None
    # tokens that end a turn besides the tokenizer's EOS (Gemma's <end_of_turn>, as its generation_config says)
    end_of_turn_tokens: tuple[str, ...] = ()
    # mixture of experts: how the router weighs the experts (layers/moe.py: ROUTERS), None for a dense model
    moe_router: str | None = None
    qk_norm_whole: bool = False        # the Q/K norms span the whole projection, not each head (OLMoE)
    # GGUF `general.architecture` values that mean this row when the file has experts (`{arch}.expert_count`)
    gguf_experts: tuple[str, ...] = ()
    # whether llama.cpp renormalises the top-k weights of this architecture's GGUF (its build_moe_ffn norm_w),
    # unless the file says so (`{arch}.expert_weights_norm`)
    gguf_norm_topk_prob: bool = False
    # what the model is for: "generate" (a decoder: generation, and embeddings from its hidden states), "embed" (an
    # encoder's embeddings only) or "score" (a cross-encoder or reranker: a relevance score per text pair)
    task: str = "generate"

    def load_class(self):
        module, cls = self.model_class.split(":")
        return getattr(importlib.import_module(f"kvflow.models.{module}"), cls)


# Gemma 3's chat template (its instruction-tuned tokenizer_config.json): no system role, a system message is folded
# into the first user turn; the assistant is "model"; image parts become <start_of_image> (refused before this)
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# llama.cpp's Qwen3.5 (`qwen35`) tensor names, after blk.N.: the Gated DeltaNet's, whole names for the tensors
# without a .weight suffix (ssm_a) or whose HF name is no piece + suffix (ssm_dt.bias), and the MTP block's own
# tensors on the block after the trunk's (its decoder layer has the usual names there: models/qwen3_5.py moves both)
QWEN3_5_GGUF_NAMES = (("post_attention_norm", "post_attention_layernorm"), ("attn_qkv", "linear_attn.in_proj_qkv"),
                      ("attn_gate", "linear_attn.in_proj_z"), ("ssm_beta", "linear_attn.in_proj_b"),
                      ("ssm_alpha", "linear_attn.in_proj_a"), ("ssm_conv1d", "linear_attn.conv1d"),
                      ("ssm_norm", "linear_attn.norm"), ("ssm_out", "linear_attn.out_proj"),
                      ("ssm_a", "linear_attn.A_log"), ("ssm_dt.bias", "linear_attn.dt_bias"),
                      ("nextn.eh_proj", "mtp.fc"), ("nextn.enorm", "mtp.pre_fc_norm_embedding"),
                      ("nextn.hnorm", "mtp.pre_fc_norm_hidden"), ("nextn.shared_head_norm", "mtp.norm"))



def qwen3_5_zero_centred(name: str) -> bool:
    """Whether a Qwen3.5 checkpoint tensor is a zero-centred norm's weight (the norm multiplies by 1 + w; llama.cpp's
    files hold 1 + w): every norm's but the Gated DeltaNet's gated norm, the MTP block's pre-fc norms among them."""
    return (name.endswith("norm.weight") or ".pre_fc_norm_" in name) and not name.endswith("linear_attn.norm.weight")


DECODER_CLASSIFIER = "decoder_classifier:DecoderForSequenceClassification"

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("LlamaForCausalLM", "llama", ("llama",), ("llama",), "llama:LlamaForCausalLM", permuted_qk=True),
    Architecture("MistralForCausalLM", "llama", ("mistral",), ("mistral",), "llama:LlamaForCausalLM",
                 permuted_qk=True, sliding_window_everywhere=True),
    # SmolLM3: a Llama whose every no_rope_layer_interval-th layer rotates nothing (NoPE: ModelConfig.nope_layers)
    Architecture("SmolLM3ForCausalLM", "smollm3", ("smollm3",), ("smollm3",), "llama:LlamaForCausalLM",
                 permuted_qk=True),
    Architecture("Qwen2ForCausalLM", "qwen2", ("qwen2",), ("qwen2",), "llama:LlamaForCausalLM", attention_bias=True),
    Architecture("Qwen3ForCausalLM", "qwen3", ("qwen3",), ("qwen3",), "llama:LlamaForCausalLM", qk_norm=True),
    Architecture("Phi3ForCausalLM", "phi3", ("phi3",), ("phi3",), "llama:LlamaForCausalLM",
                 sliding_window_everywhere=True,
                 gguf_tensor_names=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj"))),
    Architecture("Gemma3ForCausalLM", "gemma3", ("gemma3_text",), ("gemma3",), "gemma3:Gemma3ForCausalLM",
                 qk_norm=True,
                 gguf_tensor_names=(("post_attention_norm", "post_attention_layernorm"),
                                    ("ffn_norm", "pre_feedforward_layernorm"),
                                    ("post_ffw_norm", "post_feedforward_layernorm")),
                 chat_template=GEMMA3_CHAT_TEMPLATE, end_of_turn_tokens=("<end_of_turn>",)),
    # mixtures of experts (models/moe.py): attention as above, the MLP a router over experts (layers/moe.py)
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", ("qwen3_moe",), ("qwen3moe",), "moe:MoeForCausalLM",
                 qk_norm=True, moe_router="softmax_topk", gguf_norm_topk_prob=True),
    Architecture("OlmoeForCausalLM", "olmoe", ("olmoe",), ("olmoe",), "moe:MoeForCausalLM",
                 qk_norm=True, qk_norm_whole=True, moe_router="softmax_topk"),
    Architecture("GraniteMoeForCausalLM", "granitemoe", ("granitemoe",), ("granitemoe",), "moe:MoeForCausalLM",
                 permuted_qk=True, moe_router="topk_softmax", gguf_norm_topk_prob=True),
    Architecture("MixtralForCausalLM", "mixtral", ("mixtral",), (), "moe:MoeForCausalLM", permuted_qk=True,
                 sliding_window_everywhere=True, moe_router="softmax_topk_renormalized", gguf_experts=("llama",),
                 gguf_norm_topk_prob=True),
    # hybrids: recurrent layers (a state per request: layers/recurrent_state.py) between attention layers
    Architecture("Lfm2ForCausalLM", "lfm2", ("lfm2",), ("lfm2",), "lfm2:Lfm2ForCausalLM", qk_norm=True,
                 gguf_tensor_names=(("token_embd_norm", "embedding_norm"),     # the final norm, after the last layer
                                    ("attn_norm", "operator_norm"), ("ffn_norm", "ffn_norm"),
                                    ("attn_output", "self_attn.out_proj"), ("attn_q_norm", "self_attn.q_layernorm"),
                                    ("attn_k_norm", "self_attn.k_layernorm"), ("ffn_gate", "feed_forward.w1"),
                                    ("ffn_up", "feed_forward.w3"), ("ffn_down", "feed_forward.w2"),
                                    ("shortconv.conv", "conv.conv"), ("shortconv.in_proj", "conv.in_proj"),
                                    ("shortconv.out_proj", "conv.out_proj"))),
    Architecture("Qwen3_5ForCausalLM", "qwen3_5", ("qwen3_5_text", "qwen3_5"), ("qwen35",),
                 "qwen3_5:Qwen3_5ForCausalLM", qk_norm=True, gguf_tensor_names=QWEN3_5_GGUF_NAMES),
    # the released Qwen3.5 checkpoints: the text model beside a vision tower, which kvflow skips (text only)
    Architecture("Qwen3_5ForConditionalGeneration", "qwen3_5", (), (), "qwen3_5:Qwen3_5ForCausalLM", qk_norm=True),
    Architecture("GraniteMoeHybridForCausalLM", "granitemoehybrid", ("granitemoehybrid",), ("granitehybrid",),
                 "granite_hybrid:GraniteHybridForCausalLM", permuted_qk=True,
                 gguf_tensor_names=(("ssm_in", "mamba.in_proj"), ("ssm_conv1d", "mamba.conv1d"),
                                    ("ssm_dt.bias", "mamba.dt_bias"), ("ssm_a", "mamba.A"), ("ssm_d", "mamba.D"),
                                    ("ssm_norm", "mamba.norm"), ("ssm_out", "mamba.out_proj"))),
    # encoders (models/bert.py): no KV cache, each prompt whole in one step
    Architecture("BertModel", "bert", ("bert",), (), "bert:BertModel", task="embed"),
    Architecture("BertForSequenceClassification", "bert", (), (), "bert:BertForSequenceClassification",
                 task="score"),
    # decoder rerankers (models/decoder_classifier.py): a score head on the last position, from the checkpoint's
    # score.weight or (hf_overrides classifier_from_token, as vLLM's Qwen3-Reranker recipe) from LM head rows
    Architecture("Qwen3ForSequenceClassification", "qwen3", (), (), DECODER_CLASSIFIER,
                 qk_norm=True, task="score"),
    Architecture("Qwen2ForSequenceClassification", "qwen2", (), (), DECODER_CLASSIFIER,
                 attention_bias=True, task="score"),
    Architecture("LlamaForSequenceClassification", "llama", (), (), DECODER_CLASSIFIER,
                 task="score"),
)
# known architectures refused on purpose: why, and what to use instead
REFUSED = {
    "Gemma3ForConditionalGeneration": "Gemma 3 with its vision tower (4B and larger, image input) is not supported; "
                                      "kvflow serves Gemma 3's text model (Gemma3ForCausalLM: 270M, 1B, or a GGUF "
                                      "of the text model, which llama.cpp's converter writes without the tower)",
}
_BY_NAME = {a.name: a for a in ARCHITECTURES}
_BY_MODEL_TYPE = {t: a for a in ARCHITECTURES for t in a.model_types}
_BY_GGUF = {g: a for a in ARCHITECTURES for g in a.gguf}
_BY_GGUF_EXPERTS = {g: a for a in ARCHITECTURES for g in a.gguf_experts}


def supported_architectures() -> str:
    return ", ".join(sorted(_BY_NAME))


def architecture_for(name: str | None, model_type: str | None = None) -> Architecture:
    """The table's row for config.json's `architectures[0]` (or, without one, its `model_type`)."""
    if name in REFUSED:
        raise ValueError(f"unsupported architecture {name!r}: {REFUSED[name]}")
    arch = _BY_NAME.get(name) if name else _BY_MODEL_TYPE.get(model_type)
    if arch is None:
        raise ValueError(f"unsupported architecture {name or model_type!r}; supported: {supported_architectures()}")
    return arch


def gguf_architecture(name: str | None, where: str = "", experts: bool = False) -> Architecture:
    """The table's row for a GGUF's `general.architecture` (`experts`: the file has experts, as Mixtral's `llama`)."""
    arch = (_BY_GGUF_EXPERTS.get(name) if experts else None) or _BY_GGUF.get(name)
    if arch is None:
        raise ValueError(f"{where}unsupported GGUF architecture {name!r}; supported: {', '.join(sorted(_BY_GGUF))}")
    if experts and arch.moe_router is None:
        raise ValueError(f"{where}GGUF architecture {name!r} with experts (expert_count) is not supported; "
                         f"mixtures of experts: {', '.join(sorted(g for a in ARCHITECTURES if a.moe_router for g in (*a.gguf, *a.gguf_experts)))}")
    return arch


# GGUF metadata `{arch}.{key}` -> the config.json key it stands for
GGUF_CONFIG_KEYS = {
    "vocab_size": "vocab_size", "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings", "attention.sliding_window": "sliding_window",
    "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size", "attention.clamp_kqv": "clip_qkv",
    "embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling",
}
# MoE config.json keys kvflow does not implement: a model that sets them is refused, naming the key
MOE_REFUSED_KEYS = {
    "shared_expert_intermediate_size": "shared experts",
    "n_shared_experts": "shared experts",
    "num_shared_experts": "shared experts",
    "shared_intermediate_size": "shared experts",
    "scoring_func": "expert gating other than softmax",
    "topk_method": "grouped expert selection",
    "moe_layer_freq": "a dense/MoE layer pattern other than decoder_sparse_step / mlp_only_layers",
}

SLIDING, FULL = "sliding_attention", "full_attention"

# a family's pooling where neither --pooling nor the model's folder says one: BERT's [CLS] (vLLM's default for
# BertModel), a decoder's last position
POOLING_DEFAULTS = {"bert": "cls"}

# a hybrid's recurrent layer kinds (RecurrentConfig.kind)
SHORT_CONV, GATED_DELTA_NET, MAMBA2 = "short_conv", "gated_delta_net", "mamba2"


@dataclass(frozen=True)
class RecurrentConfig:
    """A hybrid model's recurrent layers: which they are and their sizes (the other layers are attention)."""
    kind: str                         # SHORT_CONV (LFM2) | GATED_DELTA_NET (Qwen3.5) | MAMBA2 (Granite 4.0 H)
    layers: tuple[int, ...]           # the recurrent layers' indices
    conv_kernel: int                  # the causal convolution's width (its state keeps conv_kernel - 1 inputs)
    conv_bias: bool = False
    # Gated DeltaNet: query/key heads, value heads (a multiple of them), their head dims
    num_key_heads: int = 0
    num_value_heads: int = 0
    key_head_dim: int = 0
    value_head_dim: int = 0
    # Mamba2: heads x head_dim = d_inner, the state size N, B/C groups, dt's clamp, in_proj/out_proj bias
    num_heads: int = 0
    head_dim: int = 0
    state_size: int = 0
    num_groups: int = 1
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    proj_bias: bool = False


def _recurrent_config(cfg: dict, family: str, layers: int) -> RecurrentConfig | None:
    """The hybrid families' recurrent layers from config.json (None for the others, and for a hybrid without any)."""
    config = _recurrent_layers(cfg, family, layers)
    return config if config is not None and config.layers else None


def _recurrent_layers(cfg: dict, family: str, layers: int) -> RecurrentConfig | None:
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if family == "lfm2":
        if types is None:
            full = set(cfg.get("full_attn_idxs") or range(layers))
            types = [FULL if i in full else "conv" for i in range(layers)]
        return RecurrentConfig(SHORT_CONV, tuple(i for i, t in enumerate(types) if t == "conv"),
                               int(cfg.get("conv_L_cache", 3)), bool(cfg.get("conv_bias", False)))
    if family == "qwen3_5":
        if types is None:
            interval = cfg.get("full_attention_interval", 4)
            types = [FULL if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        return RecurrentConfig(GATED_DELTA_NET, tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                               int(cfg.get("linear_conv_kernel_dim", 4)),
                               num_key_heads=int(cfg["linear_num_key_heads"]),
                               num_value_heads=int(cfg["linear_num_value_heads"]),
                               key_head_dim=int(cfg["linear_key_head_dim"]),
                               value_head_dim=int(cfg["linear_value_head_dim"]))
    if family == "granitemoehybrid":
        if types is None:
            types = ["mamba"] * layers
        heads = int(cfg.get("mamba_n_heads", 128))
        head_dim = cfg.get("mamba_d_head", "auto")
        if head_dim in (None, "auto"):
            head_dim = int(cfg.get("mamba_expand", 2)) * cfg["hidden_size"] // heads
        limit = cfg.get("time_step_limit") or (0.0, float("inf"))
        return RecurrentConfig(MAMBA2, tuple(i for i, t in enumerate(types) if t in ("mamba", "linear_attention")),
                               int(cfg.get("mamba_d_conv", 4)), bool(cfg.get("mamba_conv_bias", True)),
                               num_heads=heads, head_dim=int(head_dim), state_size=int(cfg.get("mamba_d_state", 256)),
                               num_groups=int(cfg.get("mamba_n_groups", 1)),
                               time_step_limit=(_json_float(limit[0]), _json_float(limit[1])),
                               proj_bias=bool(cfg.get("mamba_proj_bias", False)))
    return None


def _json_float(value) -> float:
    """A float from config.json, where transformers writes infinity and NaN as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


@dataclass(frozen=True)
class ModelConfig:
    family: str                       # "llama" | "qwen2" | "qwen3" | "phi3" | "gemma3" (ARCHITECTURES)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's rope_scaling dict (llama3, linear; longrope's short factors)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False             # RMSNorm on per-head q and k (Qwen3, Gemma 3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "LlamaForCausalLM"   # the ARCHITECTURES row (its name)
    hidden_act: str = "silu"          # the MLP's gate activation: silu, or gelu_pytorch_tanh (Gemma 3)
    rotary_dim: int | None = None     # rotated dims per head (partial_rotary_factor; None: all of head_dim)
    # sliding-window attention: a layer typed "sliding_attention" attends to its last `sliding_window` keys only
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None        # per layer, SLIDING or FULL (None: every layer FULL)
    rope_local_theta: float | None = None             # RoPE base of the sliding layers (Gemma 3's local 10k)
    query_pre_attn_scalar: float | None = None        # attention scale = this ** -0.5 (None: head_dim ** -0.5)
    final_logit_softcapping: float | None = None      # logits = cap * tanh(logits / cap)
    # mixture of experts (num_experts 0: dense): layers/moe.py
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0    # each expert's intermediate size
    norm_topk_prob: bool = False      # the top-k weights renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()    # layers whose MLP is dense (Qwen3-MoE's mlp_only_layers, decoder_sparse_step)
    clip_qkv: float | None = None     # q, k, v clamped to +-this after the projections and norms (OLMoE)
    # Granite's scalings: the embedding times this, each block's output times this before the residual add, the
    # attention scale itself (not head_dim ** -0.5), the logits divided by this
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None
    # hybrids: the recurrent layers (None: every layer is attention)
    recurrent: RecurrentConfig | None = None
    attn_output_gate: bool = False    # q_proj also gives a per-head gate on the attention's output (Qwen3.5)
    nope_layers: tuple[int, ...] = ()  # attention layers that rotate nothing (Granite 4.0 H: all; SmolLM3: every 4th)
    # the checkpoint's multi-token-prediction layers (Qwen3.5's mtp.* block, config.json's mtp_num_hidden_layers, a
    # GGUF's nextn_predict_layers): a drafter for speculative decoding's "mtp" method; 0: none
    mtp_layers: int = 0
    # encoders (BERT): token type embeddings (0: none); a classifier's labels (a cross-encoder scores with one)
    type_vocab_size: int = 0
    num_labels: int = 0
    # the model's own pooling where its folder says it (sentence-transformers' 1_Pooling/config.json: "mean",
    # "cls", "last"; None: the family's default, POOLING_DEFAULTS) and whether its vectors are L2-normalised (a
    # Normalize module; True where no sentence-transformers folder says otherwise)
    pooling: str | None = None
    normalize: bool = True
    max_seq_length: int | None = None  # sentence-transformers' max_seq_length: the context it was trained for
    # a score model's activation on its logit by default: sigmoid (vLLM's and sentence-transformers' CrossEncoder
    # default for one label), or none where config.json's sentence_transformers.activation_fn is Identity
    score_sigmoid: bool = True
    # a decoder reranker's score from LM head rows (vLLM's hf_overrides classifier_from_token): the tokens, their
    # vocabulary ids (model_files resolves them with the tokenizer); two tokens score P(second) of a softmax over
    # both (from_2_way_softmax: the head row second - first, then the sigmoid); one token, its logit
    classifier_from_token: tuple[str, ...] = ()
    classifier_token_ids: tuple[int, ...] = ()

    @property
    def arch(self) -> Architecture:
        return _BY_NAME[self.architecture]

    @property
    def tasks(self) -> tuple[str, ...]:
        """What requests the model serves: "generate" (completions, chat), "embed" (/v1/embeddings), "score" (a
        relevance score per text pair: /score, /rerank). A decoder embeds from its hidden states as well."""
        task = self.arch.task
        return ("generate", "embed") if task == "generate" else (task,)

    @property
    def encoder_only(self) -> bool:
        return self.family == "bert"

    @property
    def max_model_len(self) -> int:
        """The longest context the model serves by default: its position table's, or sentence-transformers'
        max_seq_length where its folder sets a shorter one (as sentence-transformers and vLLM truncate to it)."""
        return min(self.max_position_embeddings, self.max_seq_length or self.max_position_embeddings)

    def pooling_for(self, setting: str | None) -> str:
        """The pooling the engine runs: `--pooling` where set, else the model's own, else its family's default
        (a score model's is fixed: its head reads one position)."""
        fixed = ("cls" if self.family == "bert" else "last") if self.arch.task == "score" else None
        if fixed is not None:
            if setting not in (None, fixed):
                raise ValueError(f"pooling={setting!r}: {self.architecture} scores from its {fixed} position; "
                                 f"leave --pooling unset")
            return fixed
        return setting or self.pooling or POOLING_DEFAULTS.get(self.family, "last")

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def is_recurrent(self, layer: int) -> bool:
        return self.recurrent is not None and layer in self.recurrent.layers

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == SLIDING

    @staticmethod
    def from_hf_dict(cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = architecture_for(archs[0] if archs else None, cfg.get("model_type"))
        family = arch.family
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        layers = cfg["num_hidden_layers"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_local_theta = cfg.get("rope_local_base_freq")
        partial = cfg.get("partial_rotary_factor")
        rope_params = cfg.get("rope_parameters")  # transformers 5 folds theta and scaling in here
        if rope_params and FULL in rope_params:   # ... per layer type (Gemma 3)
            local, rope_params = rope_params.get(SLIDING) or {}, rope_params[FULL]
            rope_local_theta = rope_local_theta or local.get("rope_theta")
        if rope_params:
            rope_theta = rope_theta or rope_params.get("rope_theta")
            partial = partial or rope_params.get("partial_rotary_factor")
            if rope_params.get("rope_type", "default") != "default" and rope_scaling is None:
                rope_scaling = dict(rope_params)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("default", None):
            rope_scaling = None
        max_positions = cfg.get("max_position_embeddings", 2048)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("longrope", "su"):
            # LongRoPE (Phi-3 128k, Phi-4-mini): transformers rotates every position of a sequence that stays within
            # the original context with the short factors, and switches the whole sequence to the long ones past
            # it. kvflow serves the first regime only: the context is capped at the original length.
            original = rope_scaling.get("original_max_position_embeddings") or cfg.get(
                "original_max_position_embeddings")
            if not original or "short_factor" not in rope_scaling:
                raise ValueError("LongRoPE scaling without original_max_position_embeddings or short_factor is "
                                 "not supported")
            rope_scaling = {**rope_scaling, "rope_type": "longrope", "original_max_position_embeddings": original,
                            "max_position_embeddings": max_positions}
            if max_positions > original:
                logger.warning("LongRoPE: serving contexts up to the original %d tokens (short factors), not %d "
                               "(the long factors are not implemented)", original, max_positions)
                max_positions = original
        encoder = (_encoder_fields(cfg, arch) if family == "bert"
                   else _classifier_fields(cfg, arch) if arch.task == "score" else {})
        if family == "gemma3" and cfg.get("attn_logit_softcapping"):
            raise ValueError("attn_logit_softcapping is not supported (Gemma 3 has none; Gemma 2 does)")
        sliding_window = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types")
        if family == "gemma3":
            if layer_types is None:       # transformers' rule: every `sliding_window_pattern`-th layer is global
                pattern = cfg.get("sliding_window_pattern") or 6
                layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        elif family in ("qwen2", "qwen3", "qwen3_moe"):
            if not cfg.get("use_sliding_window"):
                layer_types = None
            elif layer_types is None:
                first = cfg.get("max_window_layers", layers)
                layer_types = [SLIDING if i >= first else FULL for i in range(layers)]
        elif family == "smollm3":
            # transformers' SmolLM3Config: with use_sliding_window, its NoPE layers are the sliding ones
            if layer_types is None:
                nope = _smollm3_nope_layers(cfg, layers)
                layer_types = [SLIDING if cfg.get("use_sliding_window") and i in nope else FULL
                               for i in range(layers)]
        elif arch.sliding_window_everywhere and sliding_window and layer_types is None:
            layer_types = [SLIDING] * layers
        elif not arch.sliding_window_everywhere:
            layer_types = None
        if not sliding_window or not layer_types or SLIDING not in layer_types:
            sliding_window, layer_types = None, None
        if layer_types is not None and len(layer_types) != layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {layers} layers")
        gemma = family == "gemma3"
        moe = _moe_fields(cfg, arch, layers)
        granite = family in ("granitemoe", "granitemoehybrid")
        recurrent = _recurrent_config(cfg, family, layers)
        hybrid = _hybrid_fields(cfg, family, layers)
        scalings = {k: float(cfg.get(k, 1.0)) for k in ("embedding_multiplier", "residual_multiplier",
                                                         "attention_multiplier", "logits_scaling")} if granite else {}
        return ModelConfig(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=hybrid.pop("intermediate_size", None) or cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", cfg.get("norm_eps", cfg.get("layer_norm_eps", 1e-6))),
            rope_theta=float(rope_theta or _DEFAULT_ROPE_THETA.get(family, 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hybrid.pop("tie_word_embeddings", cfg.get("tie_word_embeddings", gemma))),
            attention_bias=bool(cfg.get("attention_bias", arch.attention_bias)),
            qk_norm=arch.qk_norm,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch.name,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or (
                "gelu_pytorch_tanh" if gemma else "silu"),
            rotary_dim=int(head_dim * partial) if partial and partial != 1.0 else None,
            sliding_window=sliding_window,
            layer_types=tuple(layer_types) if layer_types else None,
            rope_local_theta=float(rope_local_theta or 10000.0) if gemma else None,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256) if gemma else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            clip_qkv=float(cfg["clip_qkv"]) if cfg.get("clip_qkv") is not None else None,
            recurrent=recurrent, **moe, **scalings, **hybrid, **encoder,
        )


def _encoder_fields(cfg: dict, arch: Architecture) -> dict:
    """A BERT's token types and, for a cross-encoder, its one label and default activation; what kvflow's BERT does
    not compute is refused, naming it."""
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"{arch.name} with position_embedding_type={kind!r} is not supported (absolute only)")
    fields = {"type_vocab_size": int(cfg.get("type_vocab_size", 2))}
    if arch.task == "score":
        labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
        if labels != 1:
            raise ValueError(f"{arch.name} with {labels} labels: kvflow scores with one-label cross-encoders "
                             "(a relevance logit per pair)")
        activation = str((cfg.get("sentence_transformers") or {}).get("activation_fn") or "")
        fields.update(num_labels=1, score_sigmoid=not activation.endswith("Identity"))
    return fields


def _classifier_fields(cfg: dict, arch: Architecture) -> dict:
    """A decoder reranker's head: LM head rows of `classifier_from_token` (vLLM's hf_overrides; two tokens need its
    from_2_way_softmax method, which is_original_qwen3_reranker implies), or the checkpoint's one-label score."""
    tokens = tuple(cfg.get("classifier_from_token") or ())
    method = cfg.get("method") or ("from_2_way_softmax" if cfg.get("is_original_qwen3_reranker") else None)
    if tokens:
        if not (len(tokens) == 1 or (len(tokens) == 2 and method == "from_2_way_softmax")):
            raise ValueError(f"{arch.name}: classifier_from_token {list(tokens)} with method {method!r}: kvflow scores "
                             'one token\'s logit, or two tokens with "method": "from_2_way_softmax" (or '
                             '"is_original_qwen3_reranker": true): P(second) of a softmax over both')
        return {"classifier_from_token": tokens, "num_labels": 1}
    labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
    if labels != 1:
        raise ValueError(f"{arch.name} with {labels} labels: kvflow scores with one label (or, from a causal LM's "
                         "head, --hf-overrides with classifier_from_token)")
    return {"num_labels": 1}


# RoPE base where config.json gives none: the families' transformers defaults
_DEFAULT_ROPE_THETA = {"gemma3": 1_000_000.0, "lfm2": 1_000_000.0, "smollm3": 2_000_000.0}


def _smollm3_nope_layers(cfg: dict, layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without position embedding: `no_rope_layers` (per layer, 1 rotates, 0 does not), else every
    `no_rope_layer_interval`-th layer (4; what llama.cpp hardcodes, since its GGUF carries neither)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        return tuple(i for i in range(layers) if (i + 1) % interval == 0)
    if len(flags) < layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {layers} layers")
    return tuple(i for i in range(layers) if not flags[i])


def _hybrid_fields(cfg: dict, family: str, layers: int) -> dict:
    """The hybrid families' other differences from a Llama: LFM2's real MLP width, Qwen3.5's gated attention output,
    Granite 4.0 H's attention without RoPE, its shared MLP's width and (Tiny, Small) its experts; and SmolLM3's
    NoPE layers (what kvflow's Llama does not compute, biases on o_proj or the MLP, is refused)."""
    if family == "smollm3":
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ValueError(f"SmolLM3ForCausalLM with {key}=true is not supported (the released models have "
                                 "none)")
        return {"nope_layers": _smollm3_nope_layers(cfg, layers)}
    if family == "lfm2":
        # transformers reads block_ff_dim over intermediate_size, tie_embedding over tie_word_embeddings (True
        # when neither is there: LiquidAI's config.json files)
        width = cfg.get("block_ff_dim") or cfg["intermediate_size"]
        if cfg.get("block_auto_adjust_ff_dim", True):       # transformers' Lfm2MLP: the config's width is not the MLP's
            width = int(2 * width / 3)
            if cfg.get("block_ffn_dim_multiplier") is not None:     # (rounded up only then, as transformers)
                width = int(cfg["block_ffn_dim_multiplier"] * width)
                multiple = cfg.get("block_multiple_of", 256)
                width = multiple * ((width + multiple - 1) // multiple)
        return {"intermediate_size": width,
                "tie_word_embeddings": bool(cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True)))}
    if family == "qwen3_5":
        return {"attn_output_gate": bool(cfg.get("attn_output_gate", True)),
                "mtp_layers": int(cfg.get("mtp_num_hidden_layers") or 0)}
    if family == "granitemoehybrid":
        nope = cfg.get("position_embedding_type") != "rope"
        fields = {"intermediate_size": cfg.get("shared_intermediate_size") or cfg["intermediate_size"],
                  "nope_layers": tuple(range(layers)) if nope else ()}
        experts, top_k = int(cfg.get("num_local_experts") or 0), int(cfg.get("num_experts_per_tok") or 0)
        if experts:         # Granite 4.0 H Tiny / Small: experts (GraniteMoE's router) beside the shared MLP
            if not 0 < top_k <= experts:
                raise ValueError(f"GraniteMoeHybridForCausalLM needs 0 < num_experts_per_tok <= num_local_experts; "
                                 f"got {top_k} and {experts}")
            fields.update(num_experts=experts, num_experts_per_tok=top_k,
                          moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
        return fields
    return {}


def _moe_fields(cfg: dict, arch: Architecture, layers: int) -> dict:
    """The ModelConfig fields of a mixture of experts (none for a dense row); a variant kvflow does not implement
    is a ValueError naming what it lacks."""
    if arch.moe_router is None:
        return {}
    for key, what in MOE_REFUSED_KEYS.items():
        if cfg.get(key):
            raise ValueError(f"{arch.name} with {key}={cfg[key]!r} is not supported: kvflow does not implement "
                             f"{what} for mixtures of experts")
    quant = cfg.get("quantization_config")
    if quant:
        raise ValueError(f"{arch.name}: experts quantized as {quant.get('quant_method', quant)!r} "
                         f"(quantization_config) are not supported; kvflow reads float safetensors or a GGUF file")
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    if not experts or not 0 < top_k <= experts:
        raise ValueError(f"{arch.name} needs num_experts (or num_local_experts) and 0 < num_experts_per_tok <= it; "
                         f"got {experts} and {top_k}")
    step = cfg.get("decoder_sparse_step") or 1
    dense = set(cfg.get("mlp_only_layers") or ()) | {i for i in range(layers) if (i + 1) % step}
    # Mixtral always renormalises; Granite's softmax over the top k sums to 1 as well
    norm = arch.moe_router != "softmax_topk" or bool(cfg.get("norm_topk_prob", False))
    return dict(num_experts=int(experts), num_experts_per_tok=int(top_k),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                norm_topk_prob=norm, dense_layers=tuple(sorted(dense)))

