"""A model folder's own pooling, as sentence-transformers saves it (vLLM reads the same files): modules.json lists
the pipeline (Transformer, then Pooling, then maybe Normalize), the Pooling module's config.json its mode, and
sentence_bert_config.json the longest input it was trained on (max_seq_length). A module kvflow does not compute
(Dense projections, max pooling, ...) is refused, naming it, rather than served as a different model; on a decoder,
which serves generation too, it is a warning and the folder's pooling is not used.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from kvflow.models.model_config import ModelConfig

MODULE_PREFIX = "sentence_transformers.models."
# 1_Pooling/config.json's switches -> kvflow's pooling
log = logging.getLogger("kvflow")
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_lasttoken": "last"}


def with_folder_pooling(folder: Path, config: ModelConfig) -> ModelConfig:
    """`config` with the folder's sentence-transformers pooling, normalization and max_seq_length (unchanged for a
    folder without modules.json)."""
    try:
        return _with_folder_pooling(folder, config)
    except ValueError as e:
        if config.arch.task != "generate":
            raise
        log.warning("%s; /v1/embeddings pools as --pooling says, not as this folder's sentence-transformers "
                    "pipeline", e)
        return config


def _with_folder_pooling(folder: Path, config: ModelConfig) -> ModelConfig:
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return config
    modules = json.loads(modules_file.read_text())
    pooling, normalize = None, False
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(MODULE_PREFIX)
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling = _pooling_mode(folder / module.get("path", ""), modules_file)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{modules_file}: the sentence-transformers module {module.get('type')!r} is not "
                             "supported (kvflow computes Transformer, Pooling and Normalize)")
    seq = None
    bert_config = folder / "sentence_bert_config.json"
    if bert_config.is_file():
        seq = json.loads(bert_config.read_text()).get("max_seq_length")
    return dataclasses.replace(config, pooling=pooling or config.pooling, normalize=normalize,
                               max_seq_length=int(seq) if seq else None)


def _pooling_mode(folder: Path, modules_file: Path) -> str:
    settings = json.loads((folder / "config.json").read_text())
    if "pooling_mode" in settings:        # newer sentence-transformers write the mode by name
        named = {"cls": "cls", "mean": "mean", "lasttoken": "last"}.get(settings["pooling_mode"])
        if named is None:
            raise ValueError(f"{folder / 'config.json'}: pooling_mode {settings['pooling_mode']!r} is not supported "
                             f"(cls, mean, lasttoken)")
        return named
    modes = [key for key, on in settings.items() if key.startswith("pooling_mode_") and on]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(f"{folder / 'config.json'}: pooling {', '.join(modes) or 'none'} is not supported (one of "
                         f"{', '.join(POOLING_MODES)}; from {modules_file})")
    return POOLING_MODES[modes[0]]
