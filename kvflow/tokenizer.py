"""Tokenizer: a transformers fast tokenizer plus the chat template, from an HF folder or a GGUF file.

A GGUF carries its vocabulary, merges, special ids and chat template as metadata. We read that metadata
with our fast header reader and hand it to transformers' own GGUF tokenizer converter, which is what
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` does too, minus its slow pass over the file
(~1 s here against ~10 s on SmolLM2). Nothing is cached on disk and the hub is never contacted.
"""
from __future__ import annotations

import functools

import json
import os
from pathlib import Path
from typing import Any, Iterable

from kvflow.models.gguf_reader import GGUFFile
from kvflow.models.model_files import ModelFiles, resolve_model_files


def flatten_content(content: Any) -> str:
    """OpenAI message content -> text: a string, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"unsupported message content part {kind!r}: only text parts are supported")
        return "\n".join(texts)
    raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _hf_from_gguf(gguf: GGUFFile):
    """A PreTrainedTokenizerFast equivalent to AutoTokenizer.from_pretrained(dir, gguf_file=name)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    md = gguf.metadata
    if "tokenizer.ggml.tokens" not in md:
        raise ValueError(f"{gguf.path} has no tokenizer in its metadata (tokenizer.ggml.tokens)")
    # same grouping as transformers.integrations.gguf.get_gguf_tokenizer
    grouped = {group: {name: md[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in md}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tok_dict, tok_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tok_dict.get("tokenizer_type") == "llama":
        tok_config.setdefault("add_bos_token", True)
    tokens = tok_dict["tokens"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = md.get(f"tokenizer.ggml.{key}")
        tok_config[name] = tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
    backend, extra = convert_gguf_tokenizer(md["general.architecture"], tok_dict)
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config, **extra)
    extra_eos = {md[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md}
    return hf, extra_eos


def _json_value(value: Any) -> Any:
    """A tokenizer setting as JSON: an AddedToken as its text, containers walked, anything else unknown as str."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "content"):          # tokenizers.AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_json_value(v) for v in value]
    return str(value)


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt ids."""

    def __init__(self, hf: Any, extra_eos_ids: Iterable[int] = ()):
        self.hf = hf
        self._backend = getattr(hf, "backend_tokenizer", None)  # the Rust tokenizer: fast encode/decode
        if self._backend is not None:
            # tokenizer.json may carry padding and truncation (sentence-transformers' exports pad to 128):
            # transformers sets both per call, kvflow encodes with the backend itself, so neither may apply
            self._backend.no_padding()
            self._backend.no_truncation()
        eos = hf.eos_token_id
        self.eos_token_id: int | None = eos
        self.eos_token_ids: set[int] = ({eos} if eos is not None else set()) | {int(i) for i in extra_eos_ids}
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)

    def encode_pair(self, first: str, second: str, max_length: int | None = None) -> tuple[list[int], int | None]:
        """A text pair joined as the tokenizer joins one (BERT: [CLS] first [SEP] second [SEP]; a tokenizer
        without a pair template: one after the other), and the position where its token_type_ids turn 1 (the
        second text's); None where they stay 0 throughout. `max_length`: truncated to it, the longer text first
        (transformers' longest_first)."""
        encoded = (self.hf(first, second) if max_length is None
                   else self.hf(first, second, truncation="longest_first", max_length=max_length))
        types = encoded.get("token_type_ids") or []
        return list(encoded["input_ids"]), (types.index(1) if 1 in types else None)

    @classmethod
    def from_model(cls, path: str | Path) -> "Tokenizer":
        """The tokenizer of a model (HF folder or .gguf file), as an engine on that model would load it."""
        return cls.from_files(resolve_model_files(path))

    @classmethod
    def from_files(cls, files: ModelFiles) -> "Tokenizer":
        """The tokenizer `resolve_model_files` found: a GGUF's metadata (already parsed) or an HF folder. The
        architecture's own chat template stands in where the tokenizer carries none, and its end-of-turn tokens
        (Gemma's <end_of_turn>) stop generation beside the EOS."""
        tok = cls._from_files(files)
        arch = files.config.arch
        if arch.chat_template and not tok.chat_template:
            tok.hf.chat_template = arch.chat_template
        vocab = tok.hf.get_vocab() if arch.end_of_turn_tokens else {}
        tok.eos_token_ids |= {vocab[t] for t in arch.end_of_turn_tokens if t in vocab}
        return tok

    @classmethod
    def _from_files(cls, files: ModelFiles) -> "Tokenizer":
        if files.tokenizer_gguf is not None:
            hf, extra = _hf_from_gguf(files.tokenizer_gguf)
            return cls(hf, extra)
        path = files.tokenizer_path
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer path does not exist or is not a folder / .gguf file: {path}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        extra: set[int] = set()
        gen_cfg = path / "generation_config.json"
        if gen_cfg.is_file():
            try:
                eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, UnicodeDecodeError):
                eos = None
            extra = set(eos) if isinstance(eos, list) else ({eos} if isinstance(eos, int) else set())
        return cls(hf, extra)

    # ------------------------------------------------------------------ text <-> ids
    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary piece, in characters (a bound on the text one token covers)."""
        return max(map(len, self.hf.get_vocab()), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    def config(self) -> dict[str, Any]:
        """The tokenizer's configuration as its tokenizer_config.json holds it (vLLM's /tokenizer_info): what
        it was built with, minus file paths, special tokens as their text, plus its class and chat template."""
        config = {k: _json_value(v) for k, v in (getattr(self.hf, "init_kwargs", None) or {}).items()
                  if k not in ("vocab_file", "merges_file")}
        config["tokenizer_class"] = type(self.hf).__name__
        if self.chat_template:
            config["chat_template"] = self.chat_template
        return config

    def id_to_piece(self, token_id: int) -> str:
        """The text one token stands for on its own (may hold a broken UTF-8 character as U+FFFD)."""
        return self.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------------ chat
    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages` (content flattened to text). kwargs go to transformers'
        apply_chat_template: `chat_template` (instead of the model's), `continue_final_message`, `tools`, and
        template variables. ValueError if there is no template."""
        if not (kwargs.get("chat_template") or self.chat_template):
            raise ValueError("this model's tokenizer has no chat template; use a completion prompt instead")
        msgs = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError("each message must be a dict with a 'role'")
            msgs.append({**m, "content": flatten_content(m.get("content"))})
        return self.hf.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **kwargs)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            add_special_tokens: bool = False, **kwargs: Any) -> list[int]:
        """Prompt token ids for `messages`; the template writes any BOS itself (add_special_tokens: the
        tokenizer adds its special tokens on top, as vLLM's field of that name does)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=add_special_tokens)
