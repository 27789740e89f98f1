"""Reading a GGUF file: its metadata, its tensor table, and a tensor's bytes as floats or as group codes.

Metadata is read here rather than by `gguf.GGUFReader`: that reader slices a numpy memmap once per vocabulary
string and takes ~5 s on the 49k-token SmolLM2 file; walking the header with `struct` over an `mmap` takes
~0.1 s. Floats come from `gguf.quants.dequantize` on in-memory arrays (~1-2 s for the whole embedded Q4_1
model); Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q4_K blocks can instead be kept as their codes and scales
(`gguf_codes.group_quantized`). This module imports no torch: the server's frontend reads the tokenizer through it.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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

    def raw(self, info: GGUFTensorInfo, row_range: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor's bytes as a fresh uint8 array, [rows, bytes per row]; `row_range`: rows [start, stop) of it
        only (rows over every dimension but the last: an expert's slice of a stacked tensor, or a slice of a matrix
        decoded a slice at a time). Read straight into the array: one copy of the bytes, never two."""
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        start, stop = row_range or (0, rows)
        row_bytes = info.nbytes // rows
        out = np.empty((stop - start, row_bytes), dtype=np.uint8)
        view, got = memoryview(out).cast("B"), 0
        with open(self.path, "rb", buffering=0) as f:
            f.seek(info.offset + start * row_bytes)
            while got < len(view):          # a single read returns at most ~2 GiB on Linux
                n = f.readinto(view[got:])
                if not n:
                    raise ValueError(f"{self.path}: tensor {info.name} runs past the end of the file (truncated?)")
                got += n
        return out


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
