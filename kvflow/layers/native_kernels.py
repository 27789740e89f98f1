"""kvflow's own CPU kernels (native_kernels.c) for 4-bit and 8-bit group-quantized weights on AVX2 CPUs, built
with the machine's C compiler on first use and called as torch custom ops (so compiled decode graphs keep them).

Used only where torch's own int4/int8 kernels are slow: a CPU with AVX2 and FMA but no native bf16 (float32
compute). Anything missing (no compiler, another ISA, a failed self-check) means None from `library()` and
torch's kernels as before, never an error. `KVFLOW_NATIVE_KERNELS=0` turns them off.

The built library is cached per source hash in $KVFLOW_CACHE_DIR or ~/.cache/kvflow (~1 s to build).
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

log = logging.getLogger("kvflow")

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
GROUP = 32


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Where these kernels beat torch's: CPU, float32 compute (no fast bf16), AVX2 + FMA."""
    if os.environ.get("KVFLOW_NATIVE_KERNELS", "1") == "0" or device.type != "cpu" or dtype != torch.float32:
        return False
    flags = platform.cpu_flags()
    return "avx2" in flags and "fma" in flags


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None (logged once) when they cannot be built or loaded here."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("native kernels: no C compiler found; torch's int4/int8 kernels instead")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("KVFLOW_CACHE_DIR") or Path.home() / ".cache" / "kvflow")
    target = cache / f"native_kernels-{key}.so"
    try:
        if not target.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:       # build aside, then rename: atomic
                built = Path(tmp) / target.name
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True,
                               capture_output=True, timeout=120)
                built.replace(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("native kernels: build or load failed (%s %s); torch's int4/int8 kernels instead", e,
                    detail.decode(errors="replace")[-500:])
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvflow_q4_linear.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.kvflow_q8_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.kvflow_paged_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr,
                                           ctypes.c_float, ptr, ctypes.c_int]
    lib.kvflow_rms_norm.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr, ctypes.c_int]
    lib.kvflow_rms_norm.restype = None
    lib.kvflow_q4_linear.restype = lib.kvflow_q8_linear.restype = lib.kvflow_paged_attention.restype = ctypes.c_int
    if not _self_check(lib):
        log.warning("native kernels: self-check against torch failed; torch's int4/int8 kernels instead")
        return None
    return lib


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (0..15, one per byte) -> GGUF's block layout [N, K / 2]: in each group of 32 columns,
    byte j holds column j (low nibble) and column j + 16 (high nibble)."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).view(n, k // GROUP, 2, GROUP // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


# The ops are defined on a plain `torch.library.Library` with CPU and fake (tracing) kernels rather than with
# `torch.library.custom_op`: its Python wrapper cost ~9 us a call, and a batch-1 decode step makes ~210 of these
# calls (measured: RMSNorm 15.5 us a call that way against 7.1 here, of which the kernel takes ~2.5).
_OPS = torch.library.Library("kvflow", "DEF")
_OPS.define("q4_linear(Tensor x, Tensor codes, Tensor scale, Tensor minimum) -> Tensor")
_OPS.define("q8_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor")
_OPS.define("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor row_seq, "
            "Tensor positions, float scale) -> Tensor")
_OPS.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")


def _q4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 @ W.T, W = code * scale + minimum per group of 32 (codes from `pack_q4`)."""
    return _run(library().kvflow_q4_linear, x, codes, scale, minimum)


def _q8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 @ W.T, W = code * scale per group of 32 (codes int8 [N, K])."""
    return _run(library().kvflow_q8_linear, x, codes, scale)


def _paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     row_seq: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] float32 attending, row t, to keys 0..positions[t] of sequence row_seq[t], whose block table
    is tables[row_seq[t]] (int64), in caches [blocks, block_size, Hkv, D] -> [T, Hq, D]. Every row is computed
    alone, in a fixed order (batch invariant)."""
    q = q.contiguous()
    out = torch.empty_like(q)
    T, Hq, D = q.shape
    if T:
        if library().kvflow_paged_attention(
                q.data_ptr(), T, Hq, k_cache.shape[2], D, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
                tables.data_ptr(), tables.shape[1], row_seq.data_ptr(), positions.data_ptr(), scale, out.data_ptr(),
                torch.get_num_threads()):
            raise MemoryError("native kernel: out of memory for attention scores")
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, float32; each row in one fixed order, the same
    in eager and compiled steps."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(rows)
    library().kvflow_rms_norm(rows.data_ptr(), rows.shape[0], rows.shape[1], weight.contiguous().data_ptr(), eps,
                              y.data_ptr(), torch.get_num_threads())
    return y.view(x.shape)


for _name, _kernel in (("q4_linear", _q4_linear), ("q8_linear", _q8_linear),
                       ("paged_attention", _paged_attention), ("rms_norm", _rms_norm)):
    _OPS.impl(_name, _kernel, "CPU")
torch.library.register_fake("kvflow::q4_linear", lambda x, codes, scale, minimum:
                            x.new_empty(*x.shape[:-1], codes.shape[0]), lib=_OPS)
torch.library.register_fake("kvflow::q8_linear", lambda x, codes, scale: x.new_empty(*x.shape[:-1], codes.shape[0]),
                            lib=_OPS)
torch.library.register_fake("kvflow::paged_attention", lambda q, *rest: torch.empty_like(q), lib=_OPS)
torch.library.register_fake("kvflow::rms_norm", lambda x, weight, eps: torch.empty_like(x), lib=_OPS)
q4_linear = torch.ops.kvflow.q4_linear.default
q8_linear = torch.ops.kvflow.q8_linear.default
paged_attention = torch.ops.kvflow.paged_attention.default
rms_norm = torch.ops.kvflow.rms_norm.default


def attention_supports(head_dim: int, kv_dtype: torch.dtype) -> bool:
    return kv_dtype == torch.float32 and head_dim % 8 == 0 and head_dim <= 256


def _run(fn, x: torch.Tensor, codes: torch.Tensor, *scales: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    y = torch.empty(rows.shape[0], codes.shape[0], dtype=torch.float32)
    if rows.shape[0]:
        err = fn(rows.data_ptr(), rows.shape[0], k, codes.data_ptr(), *[s.data_ptr() for s in scales],
                 codes.shape[0], y.data_ptr(), torch.get_num_threads())
        if err:
            raise MemoryError("native kernel: out of memory for its int8 activations")
    return y.view(*x.shape[:-1], codes.shape[0])


def _self_check(lib: ctypes.CDLL) -> bool:
    """Both kernels against torch on random weights (odd row counts included): within what int8 activations
    explain (~1% of the output's scale)."""
    g = torch.Generator().manual_seed(0)
    n, k = 40, 96
    codes4 = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // GROUP, generator=g) * 0.1
    minimum = -8 * scale
    w4 = (codes4.float().view(n, -1, GROUP) * scale[..., None] + minimum[..., None]).view(n, k)
    w8 = (codes8.float().view(n, -1, GROUP) * scale[..., None]).view(n, k)
    for rows in (1, 5, 70):
        x = torch.randn(rows, k, generator=g)
        for fn, w, args in ((lib.kvflow_q4_linear, w4, (pack_q4(codes4), scale, minimum)),
                            (lib.kvflow_q8_linear, w8, (codes8, scale))):
            want = x @ w.T
            got = _run(fn, x, *args)
            if not torch.allclose(got, want, rtol=0, atol=0.02 * want.abs().max().item()):
                return False
    return True
