"""ModelRunner: owns the model, the KV tensors and the sampler; turns a SchedulerOutput into tensors,
runs one forward over the flat batch, and returns one sampled token per sampling request.

The batch is laid out decodes first (one token each, attended in one batched call), then prefill chunks.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from kvflow import platform
from kvflow.config import EngineConfig
from kvflow.core.outputs import SchedulerOutput
from kvflow.layers.quantization import QUANT_DTYPES, quantize_model
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.loader import iter_weights
from kvflow.models.model_config import ModelConfig
from kvflow.request import Request
from kvflow.runner.forward_context import AttentionMetadata, PrefillSeq, forward_context
from kvflow.sampler import Sampler

log = logging.getLogger("kvflow")

MODEL_FAMILIES = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM}


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path, max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.device = platform.pick_device(config.device)
        self.dtype = platform.pick_dtype(config.dtype, self.device)
        platform.setup_threads(self.device)

        t0 = time.perf_counter()
        with torch.device(self.device):
            model = MODEL_FAMILIES[model_config.family](model_config, max_model_len)
        model.load_weights(iter_weights(model_path))
        # weights in the compute dtype; the rotary tables stay float32 (norms compute in float32 inside)
        self.model = model.to(self.dtype)
        model.rotary.float()
        if config.quantization in QUANT_DTYPES:
            quantize_model(model, config.quantization, self.dtype)
        self.model.eval()
        self.weights_bytes = sum(t.numel() * t.element_size() for name, t in
                                 [*model.named_parameters(), *model.named_buffers()] if not name.startswith("rotary"))
        self.load_seconds = time.perf_counter() - t0

        self.num_blocks = self._allocate_kv_cache()
        self.sampler = Sampler(self.device)

    # ---- KV cache ------------------------------------------------------------------------------
    def _allocate_kv_cache(self) -> int:
        cfg = self.model_config
        self.kv_dtype = torch.float8_e4m3fn if self.config.kv_cache_dtype == "fp8" else self.dtype
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        per_block = 2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads * cfg.head_dim * elem
        budget = platform.kv_cache_budget(self.device, self.config.kv_cache_memory,
                                          self.config.gpu_memory_utilization, self.weights_bytes)
        num_blocks = budget // per_block
        need = -(-self.max_model_len // self.block_size)
        if num_blocks < need:
            raise ValueError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB = {max(num_blocks, 0)} blocks of {self.block_size} "
                f"tokens) cannot hold one request of max_model_len={self.max_model_len} ({need} blocks); "
                f"raise kv_cache_memory / gpu_memory_utilization or lower max_model_len")
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        # zeroed, not empty: batched decode reads padded slots under a mask, and a NaN bit pattern
        # there would still poison the output (0 * NaN)
        storage = torch.uint8 if elem == 1 else self.kv_dtype     # CPU torch cannot fill float8 tensors
        for attn in self.model.attention_layers:
            attn.k_cache = torch.zeros(shape, dtype=storage, device=self.device).view(self.kv_dtype)
            attn.v_cache = torch.zeros(shape, dtype=storage, device=self.device).view(self.kv_dtype)
        self.kv_cache_bytes = num_blocks * per_block
        return num_blocks

    # ---- one step ------------------------------------------------------------------------------
    def prepare_inputs(self, sched: SchedulerOutput, requests: dict[str, Request],
                       block_tables: dict[str, list[int]]):
        bs = self.block_size
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills

        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        logits_indices: list[int] = []
        sampling_ids: list[str] = []

        nd = len(decodes)
        meta = AttentionMetadata(slot_mapping=None, num_decode_tokens=nd)
        if nd:
            tables = [block_tables[s.request_id] for s in decodes]
            width = max(len(t) for t in tables)
            bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            pos = torch.tensor([s.num_computed_tokens for s in decodes], dtype=torch.long)
            input_ids += [requests[s.request_id].token_ids[s.num_computed_tokens] for s in decodes]
            positions.append(pos)
            slots.append(bt[torch.arange(nd), pos // bs] * bs + pos % bs)
            meta.decode_block_tables = bt.to(self.device)
            key_pos = torch.arange(width * bs)
            meta.decode_key_mask = (key_pos[None, :] <= pos[:, None])[:, None, None, :].to(self.device)
        row = nd
        for s in prefills:
            req = requests[s.request_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            table = torch.tensor(block_tables[s.request_id], dtype=torch.long)
            pos = torch.arange(start, end, dtype=torch.long)
            input_ids += req.token_ids[start:end]
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            meta.prefills.append(PrefillSeq(row, s.num_new_tokens, end, table.to(self.device)))
            row += s.num_new_tokens
        row = 0
        for s in ordered:
            row += s.num_new_tokens
            if s.samples:
                logits_indices.append(row - 1)
                sampling_ids.append(s.request_id)
        meta.slot_mapping = torch.cat(slots).to(self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.cat(positions).to(self.device)
        return ids, pos, meta, torch.tensor(logits_indices, dtype=torch.long, device=self.device), sampling_ids

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, requests: dict[str, Request],
                block_tables: dict[str, list[int]]) -> tuple[dict[str, int], dict[str, dict | None]]:
        ids, pos, meta, logits_indices, sampling_ids = self.prepare_inputs(sched, requests, block_tables)
        with forward_context(meta):
            hidden = self.model(ids, pos)
        if not sampling_ids:
            return {}, {}
        logits = self.model.compute_logits(hidden[logits_indices])
        reqs = [requests[r] for r in sampling_ids]
        tokens, logprobs = self.sampler(logits, reqs)
        lp = logprobs or [None] * len(tokens)
        return dict(zip(sampling_ids, tokens)), dict(zip(sampling_ids, lp))
