"""Building and loading kvflow's C kernels (kernels/csrc/*.c), and whether they run here.

Built with the machine's C compiler on first use, cached per source hash in $KVFLOW_CACHE_DIR or ~/.cache/kvflow
(~4 s to build), loaded with ctypes, told the table of weight formats (formats.py) and checked against torch before
the first use. Anything missing (no compiler, no AVX2/FMA, a failed self-check) means None from `library()` and
torch's kernels, never an error. `KVFLOW_NATIVE_KERNELS=0` turns them off; `KVFLOW_NATIVE_ISA=avx2` runs the AVX2
kernels on an AVX-512 machine (to compare them).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvflow import platform
from kvflow.kernels import formats

log = logging.getLogger("kvflow")

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-pthread"]


class Experts(ctypes.Structure):
    """kernels.h's experts_t: one kind of matrix of every expert of a mixture-of-experts layer, stacked."""
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("minimum", ctypes.c_void_p),
                ("codes_stride", ctypes.c_int64), ("scale_stride", ctypes.c_int64),
                ("minimum_stride", ctypes.c_int64), ("bits", ctypes.c_int), ("flags", ctypes.c_int)]


class StateRuns(ctypes.Structure):
    """kernels.h's state_runs_t: a step's runs of rows continuing one state slot each, and its snapshots
    (kernels/recurrent.py's StateBatch)."""
    _fields_ = [("starts", ctypes.c_void_p), ("run_slots", ctypes.c_void_p), ("runs", ctypes.c_int64),
                ("snapshot_rows", ctypes.c_void_p), ("snapshot_slots", ctypes.c_void_p),
                ("snapshots", ctypes.c_int64), ("slots", ctypes.c_int64)]


_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# the library's entry points as Python calls them: (restype, argtypes); kernels.h declares each
SIGNATURES = {
    "kvflow_x16_set_format": (_int, [_int, _i64]),
    "kvflow_x16_use_avx512": (None, [_int]),
    "kvflow_x16_linear": (_int, [_int, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _int, _int, _int]),
    "kvflow_paged_attention": (_int, [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _f32,
                                      _ptr, _int, _int, _i64]),
    "kvflow_rms_norm": (None, [_ptr, _i64, _i64, _ptr, _f32, _ptr, _int]),
    "kvflow_lora_add": (_int, [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _int]),
    "kvflow_moe_experts": (_int, [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, Experts, _i64, Experts, _i64, _ptr,
                                  _int]),
    "kvflow_moe_route": (_int, [_ptr, _i64, _i64, _ptr, _i64, _i64, _int, _int, _ptr, _ptr, _int]),
    "kvflow_decoder_step": (_int, [_ptr, _ptr, _ptr, _ptr, _ptr]),
    "kvflow_decoder_step_scratch": (_i64, [_ptr, _ptr, _i64]),
    "kvflow_causal_conv1d": (_int, [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, StateRuns, _int, _ptr, _int]),
    "kvflow_gated_delta_rule": (_int, [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, StateRuns,
                                       _ptr, _int]),
    "kvflow_ssm_scan": (_int, [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, StateRuns,
                               _ptr, _int]),
    "kvflow_sigmoid_mul": (None, [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr]),
    "kvflow_gdn_gates": (None, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr]),
    "kvflow_gated_rms_norm": (None, [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _f32, _ptr, _int]),
    "kvflow_mamba2_gates": (None, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _f32, _f32, _ptr, _ptr]),
    "kvflow_gated_group_rms_norm": (None, [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _f32, _ptr, _int]),
    "kvflow_recurrent_use_avx512": (None, [_int]),
    "kvflow_pool_quiesce": (None, []),
    "kvflow_pool_workers": (_int, []),
    "kvflow_pool_rows": (_int, []),
    "kvflow_pool_set_stall": (None, [_int]),
}


def wanted(device: torch.device, dtype: torch.dtype, quantization: str | None = None) -> bool:
    """Where these kernels run: CPU with AVX2 + FMA, float32 compute, or bfloat16 compute where they also multiply
    the weights (4-bit codes: `quantization` "gguf" or "int4"; a float checkpoint's bf16 matmuls are oneDNN's)."""
    if os.environ.get("KVFLOW_NATIVE_KERNELS", "1") == "0" or device.type != "cpu":
        return False
    if dtype != torch.float32 and not (dtype == torch.bfloat16 and quantization in ("gguf", "int4")):
        return False
    flags = platform.cpu_flags()
    return "avx2" in flags and "fma" in flags


def usable() -> bool:
    """kvflow's kernels can run here (CPU flags, compiler, self-check), whatever the dtype chosen."""
    return wanted(torch.device("cpu"), torch.float32) and library() is not None


def compute_dtype(device: torch.device, dtype_setting: str, quantization: str | None) -> torch.dtype | None:
    """float32 for dtype=auto where the weights are 4-bit codes ("gguf", "int4") on a CPU that runs these kernels:
    they compute in float32, and then every step's matmuls, attention and norms are kvflow's batch-invariant
    kernels, also where the CPU has fast bf16 (on AVX-512 VNNI as fast as torch's bf16 int4 kernel at one row and
    ~2x faster from 32 rows, docs/performance.md). None elsewhere: platform.pick_dtype decides."""
    if dtype_setting == "auto" and quantization in ("gguf", "int4") and device.type == "cpu" and usable():
        return torch.float32
    return None


def has_avx512_vnni() -> bool:
    """The CPU runs the AVX-512 VNNI kernels (AVX-512 F and BW, VNNI)."""
    return {"avx512f", "avx512bw", "avx512_vnni"} <= platform.cpu_flags()


@functools.cache
def isa() -> str:
    """"avx512" (the VNNI kernels) where the CPU has them, else "avx2"."""
    return "avx512" if has_avx512_vnni() and os.environ.get("KVFLOW_NATIVE_ISA", "") != "avx2" else "avx2"


def sources() -> list[Path]:
    """The C files the library is built from (every one in csrc/: a new operation's file is picked up as it is)."""
    return sorted(CSRC.glob("*.c"))


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None (logged once) when they cannot be built or loaded here."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("native kernels: no C compiler found; torch's int4/int8 kernels instead")
        return None
    files = [*sources(), *sorted(CSRC.glob("*.h"))]
    source = b"".join(p.name.encode() + p.read_bytes() for p in files)
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("KVFLOW_CACHE_DIR") or Path.home() / ".cache" / "kvflow")
    target = cache / f"native_kernels-{key}.so"
    try:
        if not target.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:       # build aside, then rename: atomic
                built = Path(tmp) / target.name
                subprocess.run([compiler, *FLAGS, *map(str, sources()), "-o", str(built)], check=True,
                               capture_output=True, timeout=300)
                built.replace(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("native kernels: build or load failed (%s %s); torch's int4/int8 kernels instead", e,
                    detail.decode(errors="replace")[-500:])
        return None
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    lib.kvflow_x16_use_avx512(int(isa() == "avx512"))
    lib.kvflow_recurrent_use_avx512(int(isa() == "avx512"))
    if not formats.register_and_check(lib):
        log.warning("native kernels: self-check against torch failed; torch's int4/int8 kernels instead")
        return None
    return lib
