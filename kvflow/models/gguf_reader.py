"""Reading a GGUF file: its metadata, its tensor table, and a tensor's bytes as floats or as group codes.

Metadata is read here rather than by `gguf.GGUFReader`: that reader slices a numpy memmap once per vocabulary
string and takes ~5 s on the 49k-token SmolLM2 file; walking the header with `struct` over an `mmap` takes
~0.1 s. Floats come from `gguf.quants.dequantize` on in-memory arrays (~1-2 s for the whole embedded Q4_1
model); Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q4_K blocks can instead be kept as their codes and scales
(`group_quantized`).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvflow.layers.group_quant import GroupQuantized

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



# ggml type id -> (bytes per block of 32, byte offset of the codes, has a min `m` after `d`, bits)
_GROUP_BLOCKS = {2: (18, 2, False, 4),      # Q4_0: d fp16, 16 bytes of nibbles; d * (q - 8)
                 3: (20, 4, True, 4),       # Q4_1: d fp16, m fp16, 16 bytes of nibbles; d * q + m
                 8: (34, 2, False, 8),      # Q8_0: d fp16, 32 int8; d * q
                 6: (22, 6, False, 5)}      # Q5_0: d fp16, qh (32 high bits), 16 bytes of nibbles; d * (q - 16)
Q4_K, Q4_K_BYTES = 12, 144                 # per 256 values: d, dmin fp16, 12 bytes of 6-bit sc/m, 128 of nibbles


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 (exact)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def group_quantized(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> GroupQuantized | None:
    """A Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q4_K matrix's blocks as codes and per-group scales (None for other types),
    codes untouched, every scale and zero the float32 value gguf's dequantize computes (group_quant.py's table):
    `.dequantize()` equals `dequantize(raw, ...)` bit for bit. Vectorized over all blocks.

    A Q4_0 / Q4_1 block's nibbles hold elements j (low) and j + 16 (high), as llama.cpp packs them; Q5_0 adds bit
    j of its 32-bit qh as element j's fifth bit and becomes 8-bit codes q - 16 (-16..15), scale d, which is
    exactly Q8_0's format. Q4_K (ggml's block_q4_K) is a group-32 4-bit asymmetric format once its two levels of
    scales are multiplied out: sub-block j of a block has scale d * sc[j] and minimum -(dmin * m[j]), and its
    codes are the low (j even) or high (j odd) nibbles of bytes 32 * (j // 2) .. + 31."""
    if len(shape) != 2:
        return None
    n, k = shape
    if qtype == Q4_K:
        return _q4_k(torch.from_numpy(raw).view(n, k // 256, Q4_K_BYTES), n, k)
    if qtype not in _GROUP_BLOCKS:
        return None
    block_bytes, codes_at, has_min, bits = _GROUP_BLOCKS[qtype]
    blocks = torch.from_numpy(raw).view(n, k // 32, block_bytes)
    d = _fp16(blocks[..., :2])
    qs = blocks[..., codes_at:]
    if bits == 8:
        return GroupQuantized(qs.contiguous().view(torch.int8).reshape(n, k), d, None, 32, 8)
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)
    if bits == 5:
        qh = blocks[..., 2:6]                                                       # little-endian uint32
        high = (qh[..., :, None] >> torch.arange(8, dtype=torch.uint8)) & 1          # [n, g, 4 bytes, 8 bits]
        codes = (codes | (high.reshape(n, k // 32, 32) << 4)).view(torch.int8) - 16
        return GroupQuantized(codes.reshape(n, k), d, None, 32, 8)
    if has_min:
        return GroupQuantized(codes.reshape(n, k), d, _fp16(blocks[..., 2:4]), 32, 4, offset=0)
    return GroupQuantized(codes.reshape(n, k), d, None, 32, 4)


def _q4_k(blocks: torch.Tensor, n: int, k: int) -> GroupQuantized:
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])                     # [n, k / 256]
    s = blocks[..., 4:16]
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]        # ggml's get_scale_min_k4: 6-bit sc and m of 8 sub-blocks
    sc = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], dim=-1)                  # [n, k / 256, 8] uint8
    m = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], dim=-1)
    qs = blocks[..., 16:].reshape(n, k // 256, 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, k)                     # sub-block 2c low, 2c + 1 high
    scale = (d[..., None] * sc.float()).reshape(n, k // 32)
    minimum = (-(dmin[..., None] * m.float())).reshape(n, k // 32)                  # d*sc*q + (-(dmin*m)): gguf's
    return GroupQuantized(codes, scale, minimum, 32, 4, offset=0, scale_parts=(d, sc.reshape(n, k // 32)),
                          zero_parts=(-dmin, m.reshape(n, k // 32)))
