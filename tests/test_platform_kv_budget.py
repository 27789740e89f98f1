"""The default KV cache budget on CPU: the smallest of 2 GiB, an eighth of RAM, a quarter of free RAM and what
max_num_seqs x max_model_len tokens can use, logged."""
from __future__ import annotations

import logging

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
