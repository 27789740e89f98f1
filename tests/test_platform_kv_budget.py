"""The default KV cache budget on CPU: the smallest of 2 GiB, an eighth of RAM, a quarter of free RAM and what
max_num_seqs x max_model_len tokens can use, logged; and the cache's pages resident only once written."""
from __future__ import annotations

import ctypes
import logging
import os

import torch

from kvflow import platform

CPU = torch.device("cpu")
GiB = 1 << 30


def budget(monkeypatch, total: int, free: int, **kw) -> int:
    monkeypatch.setattr(platform, "total_memory", lambda device: total)
    monkeypatch.setattr(platform, "available_memory", lambda device: free)
    return platform.kv_cache_budget(CPU, None, None, 100 << 20, **kw)


def test_an_8_gb_laptop_gets_1_gib_and_a_big_machine_2(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="kvflow"):
        assert budget(monkeypatch, 8 * GiB, 6 * GiB) == GiB
    assert "1024 MiB by default (1/8 of RAM" in caplog.text
    assert budget(monkeypatch, 64 * GiB, 60 * GiB) == 2 * GiB
    assert budget(monkeypatch, 64 * GiB, 2 * GiB) == GiB // 2                 # a busy machine: 1/4 of free
    assert budget(monkeypatch, 64 * GiB, 60 * GiB, ranks_on_this_machine=2) == GiB


def test_the_cache_is_no_larger_than_its_requests_can_use(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="kvflow"):
        assert budget(monkeypatch, 64 * GiB, 60 * GiB, full_context_bytes=300 << 20) == 300 << 20
    assert "max_num_seqs x max_model_len tokens" in caplog.text


def test_explicit_budgets_win(monkeypatch):
    assert budget(monkeypatch, 8 * GiB, 6 * GiB) == GiB
    assert platform.kv_cache_budget(CPU, 3 * GiB, None, 0) == 3 * GiB
    assert platform.kv_cache_budget(CPU, 4 * GiB, None, 0, tensor_parallel_size=2) == 2 * GiB
    monkeypatch.setattr(platform, "total_memory", lambda device: 8 * GiB)
    assert platform.kv_cache_budget(CPU, None, 0.5, GiB) == 3 * GiB


def resident_pages(t: torch.Tensor) -> int:
    """How many of the pages under `t` are in memory (mincore(2))."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    count = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // page)
    pages = (ctypes.c_ubyte * count)()
    assert ctypes.CDLL("libc.so.6").mincore(ctypes.c_void_p(start), ctypes.c_size_t(count * page), pages) == 0
    return sum(p & 1 for p in pages)


def test_the_kv_cache_is_resident_only_where_tokens_were_written():
    from kvflow import LLM, SamplingParams
    llm = LLM(max_model_len=256, kv_cache_memory="64MiB")
    runner = llm.engine.runner
    k = runner.model.attention_layers[0].k_cache
    block_bytes = k[0].numel() * k.element_size()
    assert k.numel() * k.element_size() > 1 << 20 and resident_pages(k) == 0     # nothing written at boot
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.prompt_token_ids) + 4 <= runner.block_size                   # one block of K written
    assert 0 < resident_pages(k) <= 2 + block_bytes // os.sysconf("SC_PAGE_SIZE")
