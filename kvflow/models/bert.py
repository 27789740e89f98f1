"""BERT-family encoders: `BertModel` (embeddings: sentence-transformers' all-MiniLM-L6-v2 and the like) and
`BertForSequenceClassification` (cross-encoders: a (query, document) pair in, a relevance logit out).

An encoder attends both ways within its prompt, so it keeps no KV cache across steps: each prompt is computed whole
in one step (the scheduler never splits one), beside the others of the step. The step's prompts are padded to its
longest and attend under a padding mask; positions restart at 0 per prompt; token_type_ids are 0, or 1 from a pair's
second text on (`token_type_starts`). The output is the last layer's hidden states of every real position, flat as
the runner laid the step out (the runner pools them as a decoder's); a classifier's `classify` takes its pooled
[CLS] states to logits.

Names and math follow transformers' BertModel (post-norm layers, absolute positions, GELU; the LayerNorms' eps is
config.json's layer_norm_eps, which ModelConfig keeps as `rms_norm_eps`); parameters carry the checkpoint's own
names, so loading is a lookup ("bert." prefixes and old gamma/beta names aside).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.models.model_config import ModelConfig

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    @property
    def attention_layers(self) -> list:
        return []                 # none keeps a KV cache

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        h = self.word_embeddings(ids) + self.token_type_embeddings(token_types) + self.position_embeddings(positions)
        return self.LayerNorm(h)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        width = self.num_heads * self.head_dim
        self.query = nn.Linear(cfg.hidden_size, width)
        self.key = nn.Linear(cfg.hidden_size, width)
        self.value = nn.Linear(cfg.hidden_size, width)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """h [B, L, hidden], mask [B, 1, 1, L] additive (-inf on padding keys) -> [B, L, heads * head_dim]."""
        B, L, _ = h.shape
        q, k, v = (proj(h).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim)


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int):
        super().__init__()
        self.dense = nn.Linear(width, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg, cfg.num_attention_heads * cfg.head_dim)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(h, mask), h)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"{cfg.architecture}: hidden_act {cfg.hidden_act!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(h))


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.attention(h, mask)
        return self.output(self.intermediate(h), h)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertPooler(nn.Module):
    """transformers' pooler: tanh(dense(h[CLS])), what a BERT classifier's head reads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, cls_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_states))


class BertModel(nn.Module):
    """The encoder; the runner feeds it a step's whole prompts (`forward`) and pools its output."""
    encoder_only = True           # the runner's mark: no KV cache, whole prompts, no decode steps

    def __init__(self, cfg: ModelConfig, max_positions: int, tp=None, plan=None):
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError(f"{cfg.architecture} does not run with tensor_parallel_size > 1")
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg)

    @property
    def attention_layers(self) -> list:
        return []                 # none keeps a KV cache

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor,
                seq_lens: list[int]) -> torch.Tensor:
        """The flat step (ids, positions, token types [T], prompts of `seq_lens` one after another) -> the last
        layer's hidden states [T, hidden]."""
        h = self.embeddings(ids, positions, token_types)
        B, L = len(seq_lens), max(seq_lens)
        lens = torch.tensor(seq_lens, device=h.device)
        real = torch.arange(L, device=h.device)[None, :] < lens[:, None]          # [B, L]
        padded = h.new_zeros(B, L, h.shape[-1])
        padded[real] = h
        mask = torch.zeros(B, 1, 1, L, dtype=h.dtype, device=h.device).masked_fill_(
            ~real[:, None, None, :], float("-inf"))
        for layer in self.encoder.layer:
            padded = layer(padded, mask)
        return padded[real]

    # the checkpoint's names for the same tensors: old TF-era LayerNorm names, the classifier's "bert." prefix
    RENAMES = ((".gamma", ".weight"), (".beta", ".bias"))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            for old, new in self.RENAMES:
                if name.endswith(old):
                    name = name[:-len(old)] + new
            if name not in params:
                if name.endswith("position_ids") or name.startswith(("cls.", "lm_head.")):
                    continue          # a buffer transformers recomputes; a pre-training head no task here reads
                raise ValueError(f"{self.config.architecture}: unexpected tensor {name!r} in the checkpoint")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"{self.config.architecture}: {name} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded - self.optional_parameters())
        if missing:
            raise ValueError(f"{self.config.architecture}: the checkpoint lacks {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}")

    def optional_parameters(self) -> set[str]:
        """Parameters a checkpoint may leave out: an embedding model's pooler (sentence-transformers pools the
        hidden states itself; some exports drop it)."""
        return {n for n, _ in self.pooler.named_parameters(prefix="pooler")}


class BertForSequenceClassification(BertModel):
    """A cross-encoder: the pair's [CLS] state through the pooler and a linear classifier to `num_labels` logits."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp=None, plan=None):
        super().__init__(cfg, max_positions, tp, plan)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] pooled [CLS] states -> [rows, num_labels] logits."""
        return self.classifier(self.pooler(cls_states.to(self.classifier.weight.dtype))).float()

    def optional_parameters(self) -> set[str]:
        return set()
