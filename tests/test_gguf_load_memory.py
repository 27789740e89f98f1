"""Reading a quantized GGUF's matrices into kvflow's weight formats holds no whole-matrix copies beyond the result:
the file's bytes, the decode's and the packing's temporaries are a slice of rows' at a time. The file mixes Q5_0 (the
embedding, 640-column matrices), Q8_0 (the untied head, the more-bits attn_v), Q4_K and Q6_K (ffn_down), as a
Qwen2.5 Q4_K_M download does (benchmarks/load_memory.py's `small` shape)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# the child's peak RSS over its start, at most this many times the packed matrices' bytes plus a fixed part (a
# matrix's codes are held while they are packed). The child runs with glibc's mmap threshold fixed at 64 KiB, so every
# freed temporary goes back to the OS at once and the peak is what was alive together, not what the heap kept: 154
# MiB on these four matrices (54 MiB packed) when each was read, decoded and packed whole (the bound fails), 97 MiB a
# slice of rows at a time
PEAK_PER_RESULT_BYTE, PEAK_FIXED = 1.5, 32 * 2**20
MATRICES = ("token_embd.weight", "output.weight", "blk.0.ffn_down.weight", "blk.1.ffn_down.weight")

# what the quantization step does with each matrix (layers/quantization.py): its codes, then its weight format's
# layout, the codes freed before the next matrix
_CHILD = """
import json, sys
import torch
from kvflow.kernels.formats import format_of
from kvflow.models import loader
from kvflow.models.gguf_reader import read_gguf

def peak_rss():      # this process's own (getrusage's ru_maxrss keeps a forking parent's across exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

g = read_gguf(sys.argv[1])
torch.zeros(1).sum()
before = peak_rss()
held, result, formats = [], 0, []
for name in sys.argv[2:]:
    codes = loader._gguf_tensor(g, g.tensors[name], keep_quantized=True).resolve()
    fmt = format_of(codes)
    held.append(fmt.pack(codes))
    del codes
    result += sum(t.numel() * t.element_size() for t in held[-1])
    formats.append(fmt.name)
peak = peak_rss()
print(json.dumps({"rise": peak - before, "result": result, "formats": formats}))
"""


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("load_memory", REPO / "benchmarks" / "load_memory.py")
    load_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_memory)
    return load_memory.make(tmp_path_factory.mktemp("load-memory") / "small-q4_k_m.gguf", "small")


def test_the_file_mixes_the_four_types(mixed_gguf):
    from gguf import GGMLQuantizationType as T

    from kvflow.models.gguf_reader import read_gguf

    types = {n: T(t.qtype).name for n, t in read_gguf(mixed_gguf).tensors.items()}
    assert [types[n] for n in MATRICES] == ["Q5_0", "Q8_0", "Q4_K", "Q6_K"]


def test_reading_and_packing_the_matrices_peaks_near_their_size(mixed_gguf):
    out = subprocess.run([sys.executable, "-c", _CHILD, str(mixed_gguf), *MATRICES], capture_output=True, text=True,
                         cwd=REPO, timeout=600, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["formats"] == ["q5", "q8", "q4", "q6"]
    assert m["rise"] <= PEAK_PER_RESULT_BYTE * m["result"] + PEAK_FIXED, (
        f"reading {len(MATRICES)} matrices ({m['result'] / 2**20:.0f} MiB packed) peaked "
        f"{m['rise'] / 2**20:.0f} MiB above the start")
