"""LoRA adapters in the PEFT format (`adapter_config.json` + `adapter_model.safetensors`): read, checked against
the base model, and turned into per-projection (A, B) pairs with the scale folded in by the caller.

Two readers over one set of checks:
- `inspect_adapter` reads only the JSON config and the safetensors header (shapes, no tensor data, no torch):
  the frontend calls it before it registers an adapter, so every refusal is a start-up error (`--lora-modules`)
  or a 400 (`/v1/load_lora_adapter`) naming the problem.
- `load_adapter` (the engine, when the adapter first needs its weights) runs the same checks and reads the tensors.

Supported: targets among the family's attention and MLP projections (models/lora_modules.py: Llama's q/k/v/o_proj
and gate/up/down_proj, LFM2's out_proj and w1/w3/w2, Granite 4.0 H's input_linear / output_linear; any subset, any
layers), `r` up to `--max-lora-rank`, scale `lora_alpha / r` (rsLoRA: `lora_alpha / sqrt(r)`). Refused, each with
its reason: DoRA, embedding / LM-head / other targets, a hybrid's recurrent projections (named), `modules_to_save`,
a bias other than "none", per-module `rank_pattern` / `alpha_pattern`, shapes that do not fit the base model,
missing files.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.models.lora_modules import LoRAModules, lora_modules
from kvflow.models.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# a PEFT tensor name: (prefix.)layers.{i}.{module, e.g. self_attn.q_proj}.lora_A|B(.adapter name).weight
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(\w+(?:\.\w+)*?)\.lora_([AB])(?:\.\w+)?\.weight")


class LoRAAdapterError(ValueError):
    """An adapter kvflow cannot serve; the message names the adapter and the problem."""


@dataclass(frozen=True)
class AdapterInfo:
    """What the header says: rank, scale and which projections of which layers it adapts."""
    path: str
    rank: int
    scale: float
    targets: tuple[str, ...]                 # projection names present (q_proj, ..., w1: lora_modules' projections)
    # "layers.{i}.{module}" (module: self_attn.q_proj, feed_forward.w1, ...) -> (A shape [r, in], B shape [out, r])
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)


@dataclass(frozen=True)
class LoRAWeights:
    """An adapter's tensors: "layers.{i}.{module}" -> (A [r, in], B [out, r]) as float32 on the CPU;
    `scale` multiplies B @ A."""
    rank: int
    scale: float
    tensors: dict = field(default_factory=dict)


def _read_config(path: Path, name: str) -> dict:
    config_file = path / CONFIG_FILE
    if not path.exists():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: path {str(path)!r} does not exist")
    if not config_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {str(path)!r} (a PEFT adapter folder "
                               f"holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        return json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {config_file}: {e}") from None


def _safetensors_header(file: Path, name: str) -> dict:
    """The tensor table of a safetensors file: name -> {"dtype", "shape", "data_offsets"} (no tensor data read)."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 * 2**20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {file} as safetensors: {e}") from None
    header.pop("__metadata__", None)
    return header


def inspect_adapter(path: str | Path, model_config: ModelConfig, max_rank: int, name: str | None = None,
                    allowed: tuple[str, ...] | None = None) -> AdapterInfo:
    """Check a PEFT adapter folder against the base model, the rank limit and the projections the server has LoRA
    slots for (`allowed`, --lora-target-modules; None: all of the family's) without reading its tensors."""
    path = Path(path).expanduser()
    name = name or path.name
    cfg = _read_config(path, name)
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: DoRA (use_dora) is not supported")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: modules_to_save {cfg['modules_to_save']} is not supported "
                               "(the adapter would replace whole modules of the base model)")
    if cfg.get("bias", "none") not in (None, "none"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: bias {cfg['bias']!r} is not supported (only \"none\")")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if cfg.get(pattern):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {pattern} (a rank or alpha per module) is not supported")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    modules = lora_modules(model_config)
    bad = []
    for target in targets:
        if _is_regex(target) or modules.matching(target, modules.shapes):
            continue
        recurrent = modules.matching(target, modules.recurrent)
        if recurrent:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: target module {target!r} is not supported: "
                                   f"{modules.refusal(recurrent[0])}")
        bad.append(target)
    if bad:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: target modules {bad} are not supported (kvflow adapts "
                               f"{', '.join(modules.projections)} of {modules.family}'s layers; not embeddings or the "
                               "LM head)")
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {str(path)!r}")
    header = _safetensors_header(weights_file, name)
    info = _check_tensors(name, str(path), {k: tuple(v["shape"]) for k, v in header.items()}, model_config,
                          modules, rank, scale)
    outside = [t for t in info.targets if allowed is not None and t not in allowed]
    if outside:
        raise LoRAAdapterError(f"LoRA adapter {name!r} adapts {', '.join(outside)}, which this server has no LoRA slots "
                               f"for (--lora-target-modules {' '.join(allowed)})")
    return info


def _is_regex(target: str) -> bool:
    return any(c in target for c in "*+?[]()|^$\\")



def _check_tensors(name: str, path: str, shapes: dict[str, tuple[int, ...]], cfg: ModelConfig,
                   modules: LoRAModules, rank: int, scale: float) -> AdapterInfo:
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        m = _KEY.fullmatch(key)
        if m is None:
            what = "embeddings" if "embed" in key else "the LM head" if "lm_head" in key else "this module"
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} adapts {what}, which kvflow does not "
                                   f"support (only {', '.join(modules.projections)} of the decoder layers)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in modules.shapes:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} adapts {module}, which kvflow does not "
                                   f"support: {modules.refusal(module)}")
        if layer >= cfg.num_hidden_layers:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}, the base model has "
                                   f"{cfg.num_hidden_layers} layers")
        if not modules.in_layer(module, layer, cfg):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} adapts {module} of layer {layer}, which is "
                                   "a recurrent layer in the base model (it has no attention; an adapter for another "
                                   "base model?)")
        pairs.setdefault(f"layers.{layer}.{module}", {})[ab] = shape
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for key, ab in pairs.items():
        module = key.split(".", 2)[2]
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key} has lora_{'A' if 'A' in ab else 'B'} but no "
                                   f"lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        n_in, n_out = modules.shapes[module]
        if a != (rank, n_in) or b != (n_out, rank):
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {key} has lora_A {list(a)} and lora_B {list(b)}; the base model's {module} "
                f"takes {n_in} inputs to {n_out} outputs, so rank {rank} needs [{rank}, {n_in}] and [{n_out}, {rank}] "
                f"(an adapter for another base model?)")
        out[key] = (a, b)
    adapted = {key.split(".", 2)[2] for key in out}
    targets = tuple(dict.fromkeys(m.rsplit(".", 1)[1] for m in modules.shapes if m in adapted))
    return AdapterInfo(path, rank, scale, targets, out)


def load_adapter(path: str | Path, model_config: ModelConfig, max_rank: int, name: str | None = None,
                 allowed: tuple[str, ...] | None = None) -> LoRAWeights:
    """The adapter's tensors as float32 (A [r, in], B [out, r]) per adapted projection, after every check."""
    from safetensors.torch import load_file

    info = inspect_adapter(path, model_config, max_rank, name, allowed)
    tensors = load_file(str(Path(path).expanduser() / WEIGHTS_FILE))
    by_module: dict[str, dict] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        by_module.setdefault(f"layers.{m.group(1)}.{m.group(2)}", {})[m.group(3)] = t.float()
    return LoRAWeights(info.rank, info.scale, {module: (ab["A"], ab["B"]) for module, ab in by_module.items()})
