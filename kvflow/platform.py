"""The only module that knows devices: which device, which dtype, how many threads, how much memory."""
from __future__ import annotations

import functools
import logging
import os

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pick_device(device: str, local_rank: int | None = None) -> torch.device:
    """`local_rank` (tensor parallelism): this process's rank among the ranks of its machine; on CUDA it takes
    cuda:{local_rank} and makes it the current device (NCCL runs its collectives on the current device)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    if local_rank is not None and device.startswith("cuda"):
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"tensor-parallel local rank {local_rank} needs cuda:{local_rank}, but this machine "
                             f"has {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX-512-BF16: oneDNN then runs bf16 matmuls natively (else bf16 is emulated and slow)."""
    return "amx_bf16" in cpu_flags() or "avx512_bf16" in cpu_flags()


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


# --kv-cache-dtype's names (vLLM's, plus float16/float32) and the element each stores; "int8" rows also carry a
# float32 scale each (layers/kv_int8.py)
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                   "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def pick_kv_dtype(kv_cache_dtype: str, dtype_setting: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type. "auto": the compute dtype, except on a CPU that computes in float32 because
    dtype=auto chose it (4-bit codes on kvflow's kernels, or no fast bf16 matmul): there the cache holds 16 bits
    (bf16 where the CPU has it, else fp16), half the bytes to hold and to read per decoded token. Measured on the
    embedded model (Zen 3): perplexity +0.008%, greedy output mostly the same (tests/test_quantization.py).
    --dtype float32 keeps a float32 cache: the exact path against transformers."""
    if kv_cache_dtype != "auto":
        return KV_CACHE_DTYPES[kv_cache_dtype]
    if device.type == "cpu" and dtype_setting == "auto" and dtype == torch.float32:
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float16
    return dtype


def small_batch_bf16_copies(dtype_setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """dtype=auto on a CPU that multiplies bf16 slowly: compute in float32, but let steps of a few rows read
    bf16 copies of the float weights, since those steps are bound by DRAM bandwidth (layers/small_batch.py)."""
    return dtype_setting == "auto" and device.type == "cpu" and dtype == torch.float32


def setup_threads(device: torch.device, ranks_on_this_machine: int = 1) -> None:
    """The engine thread runs the model with every core (DESIGN: one process on CPU); with tensor parallelism
    the ranks of one machine share its cores evenly, so they do not fight over them."""
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_this_machine))


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent exits (PR_SET_PDEATHSIG), even if the parent never cleans up:
    the engine process and the decode-step compiler."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def release_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim), once, after loading: the float model that
    quantized weights are built from is freed in pieces below glibc's mmap threshold (it rises to 32 MiB after the
    first large free), so without this the process kept its load-time peak (0.5B-class Q4_K_M: see
    docs/performance.md)."""
    if os.name != "posix":
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):      # not glibc
        pass


# Set in an engine process, whose HTTP frontend shares this machine's cores (engine_process.main); the kernel plan
# gives such a process's small steps one core fewer where they run on OpenMP (kernels/plan.py)
frontend_shares_cores = False


def zeros_resident_when_written(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on CPU in an anonymous mmap of their own, whose pages the OS maps to its zero page until they are first
    written, so they count in the process's memory only once used. The KV cache: torch.zeros writes every page at
    boot (the embedded model with a 1 GiB cache: 1,410 MiB resident after boot, against 386 MiB this way; llama.cpp
    clears its whole cache when it allocates it, docs/performance.md, "Memory")."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import math
    import mmap

    nbytes = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)     # keeps `pages` alive


def available_memory(device: torch.device) -> int:
    """Free bytes: device memory on CUDA, MemAvailable on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# On CPU, without a budget, the KV cache takes the smallest of: this much, an eighth of the machine's RAM, a quarter
# of what is free now, and (where the caller says) what max_num_seqs requests of max_model_len tokens can use. A
# few GiB is hundreds of thousands of tokens for small models; reserving most of RAM would starve everything else,
# and on a 2-core 8 GB laptop 2 GiB of cache beside the weights, torch and a browser is too much (1 GiB there).
CPU_DEFAULT_KV_CACHE_BYTES = 2 << 30
CPU_DEFAULT_RAM_FRACTION = 8


def kv_cache_budget(device: torch.device, kv_cache_memory: int | None, utilization: float | None,
                    weights_bytes: int, tensor_parallel_size: int = 1, ranks_on_this_machine: int = 1, *,
                    full_context_bytes: int | None = None) -> int:
    """Bytes this rank may give its KV cache. `kv_cache_memory` is the total over all tensor-parallel ranks
    (each rank gets an equal share); `utilization` is per device on CUDA; on CPU the ranks of one machine
    share its RAM, so its fraction (or the default budget) is split among them. `weights_bytes`: this rank's.
    `full_context_bytes`: this rank's KV bytes for max_num_seqs requests of max_model_len tokens each, the most
    the cache can ever use (bounds the CPU default only)."""
    if kv_cache_memory is not None:
        return kv_cache_memory // tensor_parallel_size
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free - torch.cuda.memory_allocated(device)
        return int(total * (utilization or 0.9)) - torch.cuda.memory_allocated(device) - used_by_others
    if utilization is not None:
        return int(total_memory(device) * utilization) // ranks_on_this_machine - weights_bytes
    bounds = {"the default": CPU_DEFAULT_KV_CACHE_BYTES,
              f"1/{CPU_DEFAULT_RAM_FRACTION} of RAM": total_memory(device) // CPU_DEFAULT_RAM_FRACTION,
              "1/4 of free RAM": available_memory(device) // 4}
    shared = {k: v // ranks_on_this_machine for k, v in bounds.items()}
    if full_context_bytes is not None:
        shared["max_num_seqs x max_model_len tokens"] = full_context_bytes
    why = min(shared, key=shared.get)
    logging.getLogger("kvflow").info(
        "KV cache: %.0f MiB by default (%s; %s) — set --kv-cache-memory to choose", shared[why] / 2**20, why,
        ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in shared.items()))
    return shared[why]
