"""ModelRunner: owns the model, the KV tensors and the sampler; turns a ModelStep into tensors, runs one
forward over the flat batch, and samples one token per sampling row. It knows nothing of requests, the
scheduler or the KV cache manager: the step carries the token ids, positions and block tables.

Under tensor parallelism every rank has a runner; only rank 0 (`tp.is_first`) has a sampler.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import torch

from kvflow import platform
from kvflow.config import EngineConfig
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.kernels import build, ops
from kvflow.kernels.plan import CoreShare, KernelPlan
from kvflow.kernels.recurrent import StateBatch
from kvflow.layers import kv_int8
from kvflow.layers.attention_metadata import AttentionMetadata, PrefillBatch
from kvflow.layers.lora import lora_mask
from kvflow.layers.moe import SparseMoE
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.layers.quantization import quantize_model
from kvflow.layers.small_batch import SMALL_BATCH_ROWS, enable_small_batch_bf16
from kvflow.models.loader import ModelFiles, iter_weights, resolve_model_files, weight_quantization, without_weight_init
from kvflow.models.model_config import ModelConfig
from kvflow.runner.compiled_decode import CompiledDecode, model_identity, plain_module_state
from kvflow.runner.mtp_drafter import MtpDrafter
from kvflow.runner.native_step import NativeDecoderStep
from kvflow.runner.state_memory import StateSlotCounts, plan_state_slots
from kvflow.runner.step import ModelStep, SampledTokens, StepBatch
from kvflow.runner.sampler import Sampler, prompt_logprobs

log = logging.getLogger("kvflow")

class ModelRunner:
    """`tp`: this process's tensor-parallel rank (default: the only one)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path, max_model_len: int,
                 tp: TensorParallel | None = None):
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        # the sliding-window layers' window (their masks are built beside the others; None: no such layer)
        self.sliding_window = model_config.sliding_window
        self.tp = tp = tp or TensorParallel()
        self.device = platform.pick_device(config.device, tp.local_rank if tp.size > 1 else None)
        files = model_path if isinstance(model_path, ModelFiles) else resolve_model_files(model_path)
        self.quantization = weight_quantization(files, config.quantization, config.dtype, tp.size, self.device.type)
        self.dtype = (build.compute_dtype(self.device, config.dtype, self.quantization)
                      or platform.pick_dtype(config.dtype, self.device))
        # the processes sharing this machine's cores: its tensor-parallel ranks, or the data-parallel engines
        self.processes_here = tp.local_size * config.data_parallel_size
        platform.setup_threads(self.device, self.processes_here)
        self.kv_dtype = platform.pick_kv_dtype(config.kv_cache_dtype, config.dtype, self.device, self.dtype)
        # which kernels compute the model, chosen before it is built: its modules take the plan
        plan = KernelPlan.choose(self.device, self.dtype, self.quantization, model_config.head_dim, self.kv_dtype,
                                 model_config.num_attention_heads // model_config.num_key_value_heads,
                                 torch.get_num_threads(), config.small_step_threads, platform.frontend_shares_cores)

        t0 = time.perf_counter()
        spec = config.speculative_config
        mtp = spec is not None and spec.method == "mtp"
        if model_config.encoder_only and (config.enable_lora or tp.size > 1 or spec is not None):
            raise ValueError(f"{model_config.architecture} is an encoder: LoRA, tensor parallelism and speculative "
                             "decoding do not apply to it")
        with torch.device(self.device), without_weight_init():
            model = model_config.arch.load_class()(model_config, max_model_len, tp, plan)
            if mtp:         # before the weights: the MTP block's tensors are loaded, not skipped
                self._enable_mtp(model)
        model.load_weights(iter_weights(files, keep_quantized=self.quantization == "gguf"))
        # weights in the compute dtype; the rotary tables stay float32 (norms compute in float32 inside)
        self.model = model.to(self.dtype)
        for rotary in model.modules():
            if isinstance(rotary, RotaryEmbedding):
                rotary.float()
        matmuls = f"{str(self.dtype).removeprefix('torch.')} weights, torch's matmuls"
        if self.quantization:
            matmuls = quantize_model(model, self.quantization, self.dtype, native=plan.native_matmuls)
            if plan.native_matmuls:
                # one native call per layer where kvflow's kernels hold the experts; before the heap is trimmed
                # (below), so the per-expert buffers it frees go back to the OS
                for moe in [m for m in model.modules() if isinstance(m, SparseMoE)]:
                    moe.use_native_kernels()
        elif platform.small_batch_bf16_copies(config.dtype, self.device, self.dtype):
            enable_small_batch_bf16(model)
            matmuls = (f"float32 compute; steps of <= {SMALL_BATCH_ROWS} rows read bfloat16 copies of the weights "
                       "(dtype=auto on a CPU without native bf16 matmul; dtype=float32 turns this off)")
        # LoRA: a term beside each projection, its slots all zero until set_lora_slot (layers/lora.py)
        self.lora = (config.max_loras, config.max_lora_rank) if config.enable_lora else None
        if self.lora:
            targets = config.lora_target_modules
            model.enable_lora(*self.lora, self.dtype, targets)
            log.info("LoRA: %d slot(s) of rank %d on %s (%s)", *self.lora, ", ".join(targets or ("every attention and "
                     "MLP projection",)), str(self.dtype).removeprefix("torch."))
        self.model.eval()
        # an encoder (models/bert.py): no KV cache, each prompt whole in its step, never a decode step
        self.encoder = bool(getattr(model, "encoder_only", False))
        # a score model's head on its pooled state (a cross-encoder's classifier): the runner hands back its logits
        self.classifies = model_config.arch.task == "score"
        # the model's recurrent layers (layers/recurrent_state.py), in layer order, found once (the model finds them
        # by walking its modules); none for a transformer
        self.state_layers = list(getattr(model, "state_layers", ()))
        self.weights_bytes = sum(t.numel() * t.element_size() for name, t in
                                 [*model.named_parameters(), *model.named_buffers()] if not name.startswith("rotary"))
        self.load_seconds = time.perf_counter() - t0

        self.kv_released = False        # release_kv_cache (sleep) dropped the KV tensors
        self.kv_budget = 0
        self.num_blocks = self._allocate_kv_cache()
        platform.release_freed_memory()
        sliding = ""
        if self.sliding_window:
            sliding = (f"; a {self.sliding_window}-token sliding window on "
                       f"{model_config.layer_types.count('sliding_attention')} of {model_config.num_hidden_layers} "
                       f"layers ({'the kernel' if plan.native_attention else 'sliding masks'}), the KV cache keeping "
                       "every block")
        self.sampler = Sampler(self.device, config.seed) if tp.is_first else None
        # the whole decoder in one native call where it computes this model (runner/native_step.py); then there is
        # nothing to compile
        self.native_step, why_not = self._build_native_step(plan.kernel_pool)
        decode_step = ("native" if self.native_step is not None
                       else "compiled" if self._compiles_decode_steps() else "layers")
        self.plan = plan.completed(matmuls, decode_step, why_not, sliding)
        log.info("%s", self.plan.describe())
        # beside a busy process a step takes the cores it leaves (kernels/plan.py's CoreShare) where the plan says its
        # bits allow it; an engine process's parent is its HTTP frontend, whose time is the server's own
        self.core_share = (CoreShare(frontend_pid=os.getppid() if platform.frontend_shares_cores else None)
                           if self.plan.yields_cores else None)
        self.compiled_decode = self._start_compiled_decode(files) if decode_step == "compiled" else None
        # speculative decoding's drafts from the model's own MTP head, made after each step (runner/mtp_drafter.py)
        self.mtp_drafter = (MtpDrafter(self.model, spec.num_speculative_tokens, max_model_len, self.block_size,
                                       self.prepare_inputs) if mtp else None)
        if mtp:
            log.info("speculative decoding: up to %d draft(s) per step from the model's multi-token-prediction head",
                     spec.num_speculative_tokens)

    def _build_native_step(self, kernel_pool: bool) -> tuple[NativeDecoderStep | None, str]:
        """The native step over the model's weights and KV tensors as they are now (it points at both)."""
        return NativeDecoderStep.build(self.model, kv_dtype=self.kv_dtype, block_size=self.block_size,
                                       dtype=self.dtype, kernel_pool=kernel_pool, tp_size=self.tp.size,
                                       lora=bool(self.lora))

    def _enable_mtp(self, model) -> None:
        """speculative_config.method "mtp": the model builds its multi-token-prediction block (a model without one
        refuses, saying why)."""
        if not hasattr(model, "enable_mtp"):
            raise ValueError(f'speculative_config.method "mtp" drafts with the model\'s own multi-token-prediction '
                             f"head, which {self.model_config.architecture} does not have (Qwen3.5's checkpoints do); "
                             "use the ngram or suffix method")
        if self.tp.size > 1:
            raise ValueError('speculative_config.method "mtp" does not run with tensor_parallel_size > 1 yet (the '
                             "drafts are made on rank 0 after sampling)")
        model.enable_mtp()

    @property
    def native_attention(self) -> bool:
        return self.plan.native_attention

    @property
    def kernel_pool(self) -> bool:
        return self.plan.kernel_pool

    @property
    def threads(self) -> int:
        return self.plan.threads

    # ---- compiled decode steps ---------------------------------------------------------------------
    def _compiles_decode_steps(self) -> bool:
        """CPU, one rank, not --enforce-eager: decode steps are compiled in the background
        (runner/compiled_decode.py). On CUDA the eager step stays (CUDA graphs are their own piece of work); under
        tensor parallelism the all-reduces stay outside any graph. An encoder or a score model never decodes."""
        if (self.config.enforce_eager or self.device.type != "cpu" or self.tp.size > 1 or self.encoder
                or self.classifies):
            return False
        if self.state_layers:
            log.info("compiled decode steps: off for %s (recurrent layers: the compiled graphs take no state slots)",
                     self.model_config.architecture)
            return False
        if not getattr(self.model, "compiled_decode", True):
            log.info("compiled decode steps: off for %s (its experts are not all on kvflow's kernels: grouping rows "
                     "by expert in Python depends on the step's data, which a whole-graph compile cannot trace)",
                     self.model_config.architecture)
            return False
        return True

    def _start_compiled_decode(self, files: ModelFiles) -> CompiledDecode:
        # no bucket beyond the first that holds max_num_seqs rows: no step could use it
        sizes = self.config.compile_batch_sizes
        fits = [b for b in sizes if b >= self.config.max_num_seqs]
        buckets = tuple(b for b in sizes if b < self.config.max_num_seqs) + tuple(fits[:1])
        model_path = Path(files.path)
        module_state = plain_module_state(self.model)
        # everything a decode graph depends on (the KV cache's block count is a dynamic dimension: not here)
        key = {"model": model_identity(model_path), "model_config": repr(self.model_config),
               "dtype": str(self.dtype), "kv_dtype": str(self.kv_dtype), "quantization": self.quantization,
               "native_attention": self.native_attention, "native_kernels": build.library() is not None,
               "block_size": self.block_size, "max_model_len": self.max_model_len,
               "cpu_flags": sorted(platform.cpu_flags()), "module_state": repr(module_state)}
        if self.lora:       # the LoRA terms are part of the graph (their slots are read live: buffers)
            key["lora"] = (*self.lora, self.config.lora_target_modules)
        per_block = self.kv_cache_bytes // self.num_blocks
        job = {"config": self.config, "model_config": self.model_config, "model_path": model_path,
               "max_model_len": self.max_model_len, "module_state": module_state,
               "kv_cache_memory": per_block * -(-self.max_model_len // self.block_size)}
        compiled = CompiledDecode(self.model, buckets, self.threads_for, key, job)
        compiled.start()
        return compiled

    def load_compiled_steps(self) -> bool:
        """Between steps (the server's idle loop): load the decode graphs compiled since; True when one was."""
        return self.compiled_decode.poll() if self.compiled_decode is not None else False

    def step_threads(self, rows: int) -> tuple[int, int]:
        """(torch's threads, kvflow's kernels' threads) for a step of `rows` rows now: the kernel plan's, on the
        cores other processes leave."""
        return self.plan.step_threads(rows, self.core_share() if self.core_share else None)

    def threads_for(self, rows: int) -> int:
        """torch's threads for a step of `rows` rows on every core (what a compiled graph bakes in)."""
        return self.plan.step_threads(rows)[0]

    def _padding_step(self, bucket: int) -> tuple:
        """A decode step of `bucket` padding rows only (the warm-up of a compiled bucket)."""
        batch = StepBatch(num_decodes=0, token_ids=[], num_computed_tokens=[], num_new_tokens=[], block_tables=[],
                          samples=[])
        ids, pos, meta, _ = self.prepare_inputs(batch, pad_to=bucket)
        # the width of the block tables (the longest context) is a dynamic dimension of the compiled graph; the
        # marks go on the compiler's inputs only (a graph loaded from a file rejects marked inputs it was not
        # compiled with)
        for t, dim in ((meta.seq_tables, 1), (meta.decode_block_tables, 1), (meta.decode_mask, 3),
                       (meta.decode_mask_sliding, 3)):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, dim)
        return ids, pos, meta

    def shutdown(self) -> None:
        if self.compiled_decode is not None:
            self.compiled_decode.stop()

    # ---- LoRA ----------------------------------------------------------------------------------
    def set_lora_slot(self, slot: int, weights) -> None:
        """Between steps: put an adapter's weights (models/lora_adapter.LoRAWeights) into `slot`, or clear it
        (None). Compiled decode graphs read the slots live."""
        if not self.lora:
            raise RuntimeError("set_lora_slot needs enable_lora")
        if weights is None:
            self.model.set_lora_slot(slot, None)
        else:
            self.model.set_lora_slot(slot, weights.tensors, weights.scale)

    # ---- KV cache ------------------------------------------------------------------------------
    def _allocate_kv_cache(self) -> int:
        if self.encoder:
            # no KV tensors: the blocks the manager hands out are bookkeeping only, enough for max_num_seqs prompts
            # of max_model_len (each prompt lives one step)
            self.state_slots, self.kv_cache_bytes = None, 0
            self.scratch_block = num_blocks = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
            return num_blocks
        cfg = self.model_config
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        # a row: one token's K (or V) of one KV head; int8 rows carry their scale (layers/kv_int8.py)
        row = kv_int8.row_bytes(cfg.head_dim) if self.kv_dtype == torch.int8 else cfg.head_dim
        num_kv_heads = self.model.sizes.num_kv_heads          # this rank's share of the heads
        attention_layers = self.model.attention_layers
        per_block = 2 * len(attention_layers) * self.block_size * num_kv_heads * row * elem
        budget = platform.kv_cache_budget(self.device, self.config.kv_cache_memory,
                                          self.config.gpu_memory_utilization, self.weights_bytes,
                                          self.tp.size * self.config.data_parallel_size, self.processes_here)
        self.kv_budget = budget      # a reload after a sleep asks for the same bytes: the same blocks and slots
        # a hybrid's recurrent layers keep state slots from the same budget (runner/state_memory.py)
        self.state_slots = self._plan_states(budget, per_block) if self.state_layers else None
        if self.state_slots is not None:
            budget -= self.state_slots.total * self.state_slots.slot_bytes
        # every rank indexes the same block ids: the rank that fits the fewest blocks sets the number
        num_blocks = self.tp.min_over_ranks(max(budget, 0) // per_block)
        need = -(-self.max_model_len // self.block_size)
        if num_blocks < need:
            raise ValueError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB = {max(num_blocks, 0)} blocks of {self.block_size} "
                f"tokens) cannot hold one request of max_model_len={self.max_model_len} ({need} blocks); "
                f"raise kv_cache_memory / gpu_memory_utilization or lower max_model_len")
        # one block more than the manager hands out: the scratch block, where padding rows (compiled decode
        # buckets, padded prefill keys) write and read, so they never touch a request's K/V
        self.scratch_block = num_blocks
        self.kv_shape = (num_blocks + 1, self.block_size, num_kv_heads, row)
        self.kv_cache_bytes = num_blocks * per_block
        self._allocate_kv_tensors()
        return num_blocks

    def _allocate_kv_tensors(self) -> None:
        """Every attention layer's K and V tensors (`kv_shape`) and every recurrent layer's state tensors."""
        # zeroed, not empty: batched decode reads padded slots under a mask, and a NaN bit pattern
        # there would still poison the output (0 * NaN); on CPU resident only once written (platform.py)
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        storage = torch.uint8 if elem == 1 else self.kv_dtype     # CPU torch cannot fill float8 tensors
        for attn in self.model.attention_layers:
            attn.k_cache = platform.zeros_resident_when_written(self.kv_shape, storage, self.device).view(self.kv_dtype)
            attn.v_cache = platform.zeros_resident_when_written(self.kv_shape, storage, self.device).view(self.kv_dtype)
        if self.state_slots is not None:
            self._bind_states(self.state_slots.total)

    # ---- sleep (--enable-sleep-mode) ----------------------------------------------------------------
    def release_kv_cache(self) -> None:
        """Drop the KV tensors and the recurrent layers' state tensors, giving their memory back to the OS (on CPU
        each is an anonymous mmap of its own); the native step, which points at them, goes with them. Between
        steps, with no request running: their contents are forgotten."""
        if self.encoder or self.kv_released:
            return
        for attn in self.model.attention_layers:
            attn.k_cache = attn.v_cache = None
        for layer in self.state_layers:
            layer.bind_state({})
        self.native_step = None
        self.kv_released = True
        platform.release_freed_memory()

    def restore_kv_cache(self) -> None:
        """The KV and state tensors again, zeroed, with the plan they had at load (the same blocks and slots: the
        core's books hold those numbers), and the native step over them."""
        if self.encoder or not self.kv_released:
            return
        self._allocate_kv_tensors()
        self.native_step, _ = self._build_native_step(self.plan.kernel_pool)
        self.kv_released = False

    # ---- recurrent state (hybrids) ------------------------------------------------------------------
    def _plan_states(self, budget: int, block_bytes: int) -> StateSlotCounts:
        """The slots' kinds by plan_state_slots (their tensors are bound with the KV tensors)."""
        layers = self.state_layers
        spec = self.config.speculative_config
        counts = plan_state_slots(budget, sum(layer.state_bytes_per_slot(self.dtype) for layer in layers), block_bytes,
                                  -(-self.max_model_len // self.block_size), self.config.max_num_seqs,
                                  spec.num_speculative_tokens if spec is not None else 0,
                                  self.config.enable_prefix_caching)
        return counts

    def _bind_states(self, total: int) -> None:
        """Every recurrent layer's state tensors, [total slots, *shape] each, zeroed (resident once written)."""
        for layer in self.state_layers:
            layer.bind_state({name: platform.zeros_resident_when_written((total, *shape), dtype, self.device)
                              for name, (shape, dtype) in layer.state_shapes(self.dtype).items()})

    def _copy_states(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Before a step: each (source, slot) copies one slot of every recurrent layer's state into another; source -1
        zeroes the slot (a request that starts from nothing: slots are reused)."""
        zero = [dst for src, dst in copies if src < 0]
        pairs = [(src, dst) for src, dst in copies if src >= 0]
        zero_t = torch.tensor(zero, dtype=torch.long, device=self.device) if zero else None
        if pairs:
            src_t = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
            dst_t = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        for layer in self.state_layers:
            for t in layer.states.values():
                if pairs:
                    t.index_copy_(0, dst_t, t.index_select(0, src_t))
                if zero_t is not None:
                    t.index_fill_(0, zero_t, 0)

    @staticmethod
    def _state_batch(batch: StepBatch, lens: list[int]) -> StateBatch:
        """The step's runs of rows continuing one state slot (consecutive rows of one slot: a speculating request's)
        and its snapshots as flat rows."""
        starts, slots, first = [], [], [0]
        for slot, n in zip(batch.state_slots, lens):
            if not slots or slots[-1] != slot:
                starts.append(first[-1])
                slots.append(slot)
            first.append(first[-1] + n)
        starts.append(first[-1])
        snaps = sorted((first[entry] + offset, slot) for entry, offset, slot in batch.state_snapshots)
        return StateBatch(torch.tensor(starts, dtype=torch.long), torch.tensor(slots, dtype=torch.long),
                          torch.tensor([r for r, _ in snaps], dtype=torch.long),
                          torch.tensor([s for _, s in snaps], dtype=torch.long))

    # ---- one step ------------------------------------------------------------------------------
    def prepare_inputs(self, batch: StepBatch, pad_to: int | None = None):
        """The step's tensors: ids, positions, attention metadata, the rows whose logits are needed. `pad_to`
        (decode-only steps run by a compiled bucket): append decode rows that write their K/V to the scratch
        block and read only it, and give the block tables at least 2 columns (the compiled graph treats the
        width as dynamic; torch specializes sizes 0 and 1)."""
        bs = self.block_size
        nd = batch.num_decodes
        rows = pad_to or nd
        ids = batch.token_ids[:nd] + [0] * (rows - nd) + batch.token_ids[nd:]
        tables = batch.block_tables[:nd] + [[self.scratch_block]] * (rows - nd) + batch.block_tables[nd:]
        lens = [1] * rows + batch.num_new_tokens[nd:]
        starts = batch.num_computed_tokens[:nd] + [0] * (rows - nd) + batch.num_computed_tokens[nd:]
        width = max(max(len(t) for t in tables), 2 if pad_to else 1)
        table = torch.tensor([t + [self.scratch_block] * (width - len(t)) for t in tables], dtype=torch.long)
        # each row's sequence and position in a few tensor ops, not one arange per sequence
        lens_t = torch.tensor(lens)
        row_seq = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
        first_row = torch.cumsum(lens_t, 0) - lens_t
        pos = torch.tensor(starts)[row_seq] + torch.arange(len(row_seq)) - first_row[row_seq]
        slots = table[row_seq, pos // bs] * bs + pos % bs
        meta = AttentionMetadata(slot_mapping=slots.to(self.device), num_decode_tokens=rows)
        if batch.state_slots:
            meta.state = self._state_batch(batch, lens)
        # every row's adapter slot (padding and base rows: -1, an all-zero mask row); an eager step of base rows only
        # skips the LoRA terms (no mask), a compiled one always takes a mask (its graph's inputs never change)
        if self.lora and (batch.lora_slots or pad_to):
            seq_slots = list(batch.lora_slots) or [-1] * len(batch.num_new_tokens)
            seq_slots = torch.tensor(seq_slots[:nd] + [-1] * (rows - nd) + seq_slots[nd:], dtype=torch.long)
            meta.lora_mask = lora_mask(seq_slots[row_seq], *self.lora, self.dtype).to(self.device)
        if self.native_attention:
            # every row, decode or prefill, attends alone over its own keys (kvflow's kernel)
            meta.seq_tables, meta.row_seq, meta.positions = table, row_seq, pos
        else:
            if rows:
                decode_width = max(max(len(t) for t in tables[:rows]), 2 if pad_to else 1)
                meta.decode_block_tables = table[:rows, :decode_width].contiguous().to(self.device)
                key_pos = torch.arange(decode_width * bs)
                meta.decode_mask = self._causal_mask(key_pos, pos[:rows, None])[:, None, None, :]
                if self.sliding_window:         # always (a compiled graph takes the same inputs every step)
                    meta.decode_mask_sliding = self._causal_mask(key_pos, pos[:rows, None],
                                                                 self.sliding_window)[:, None, None, :]
            if nd < len(batch.num_new_tokens):
                meta.prefill = self._prefill_batch(batch)
        # the sampling rows' last positions, then the positions whose logits give prompt logprobs (rare)
        logits_indices, prompt_positions, row = [], [], 0
        for i, (n, samples) in enumerate(zip(batch.num_new_tokens, batch.samples)):
            if batch.prompt_logprob_spans and batch.prompt_logprob_spans[i][1]:
                offset, count = batch.prompt_logprob_spans[i]
                prompt_positions += range(row + offset, row + offset + count)
            row += n
            if samples:
                logits_indices.append(row - 1)
        logits_indices += prompt_positions
        ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return ids, pos.to(self.device), meta, torch.tensor(logits_indices, dtype=torch.long, device=self.device)

    def _prefill_batch(self, batch: StepBatch) -> PrefillBatch:
        """Index tensors and the offset-causal mask that let every prefill chunk attend in one padded call."""
        bs, nd = self.block_size, batch.num_decodes
        starts, lens = batch.num_computed_tokens[nd:], batch.num_new_tokens[nd:]
        tables = [torch.tensor(t, dtype=torch.long) for t in batch.block_tables[nd:]]
        P, Lq, Lk = len(lens), max(lens), max(s + n for s, n in zip(starts, lens))
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        window = self.sliding_window
        if P == 1 and starts[0] == 0:
            sliding = None
            if window and Lq > window:        # the chunk's own keys, causal and windowed
                sliding = self._causal_mask(torch.arange(Lq), torch.arange(Lq)[:, None], window)[None, None]
            return PrefillBatch(1, Lq, Lk, empty, empty, empty, None, sliding)
        query_rows = torch.zeros(P, Lq, dtype=torch.long)
        key_slots = torch.full((P, Lk), self.scratch_block * bs, dtype=torch.long)
        query_pos = torch.zeros(P, Lq, dtype=torch.long)
        output_rows, row = [], 0
        for i, (table, start, n) in enumerate(zip(tables, starts, lens)):
            query_rows[i, :n] = torch.arange(row, row + n)
            output_rows.append(torch.arange(i * Lq, i * Lq + n))
            query_pos[i] = torch.arange(start, start + Lq)     # pad rows see keys 0..start+r: never all masked
            key_pos = torch.arange(start + n)
            key_slots[i, :start + n] = table[key_pos // bs] * bs + key_pos % bs
            row += n
        mask = self._causal_mask(torch.arange(Lk), query_pos[:, :, None])[:, None]
        sliding = None
        if window and Lk > window:
            sliding = self._causal_mask(torch.arange(Lk), query_pos[:, :, None], window)[:, None]
        return PrefillBatch(P, Lq, Lk, query_rows.flatten().to(self.device), torch.cat(output_rows).to(self.device),
                            key_slots.flatten().to(self.device), mask, sliding)

    def _causal_mask(self, key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """Additive mask (0 where key_pos <= query_pos, else -inf) in the compute dtype: SDPA would otherwise turn a
        boolean mask into this once per layer. `window`: also -inf where key_pos <= query_pos - window."""
        allowed = key_pos <= query_pos
        if window:
            allowed &= key_pos > query_pos - window
        return torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, float("-inf")).to(self.device)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every rank's part of a step: the forward, then the logits of the sampling rows (rank 0 gets the whole
        vocabulary's; other ranks, and steps where no request samples, get None) and, on rank 0, the pooled hidden
        states of the pooling rows (None when none pools). A decode-only step whose padded size has a compiled graph
        ready runs that graph (eagerly if the graph fails)."""
        logits, pooled, _ = self._forward(batch)
        if self.kernel_pool:
            ops.quiesce()        # no pool worker reads this step's memory after it (thread_pool.c)
        return logits, pooled

    def _forward(self, batch: StepBatch):
        """`forward`'s work, and the step's flat rows as computed (ids, positions, metadata, final hidden states)."""
        bucket = self.compiled_decode.bucket_for(batch) if self.compiled_decode else None
        threads, kernel_threads = self.step_threads(bucket or len(batch.num_new_tokens))
        if bucket:
            threads = self.threads_for(bucket)      # the count its graph was compiled for (its guards check it)
        if not bucket and self.compiled_decode is not None and self.compiled_decode.compiling:
            # a core for the compiler process (compile_worker.py says why)
            threads, kernel_threads = max(1, threads - 1), max(1, kernel_threads - 1)
        if threads != torch.get_num_threads():     # only when it changes: the call is not free
            torch.set_num_threads(threads)
        ops.set_threads(kernel_threads)
        if self.encoder:
            return self._encode(batch)
        if batch.state_copies:
            self._copy_states(batch.state_copies)
        hidden = None
        if self.native_step is not None:
            ids, pos, meta, logits_indices = self.prepare_inputs(batch)
            hidden = self.native_step(ids, pos, meta)
        elif bucket:
            ids, pos, meta, logits_indices = self.prepare_inputs(batch, pad_to=bucket)
            hidden = self.compiled_decode(ids, pos, meta)
        if hidden is None:
            ids, pos, meta, logits_indices = self.prepare_inputs(batch)
            hidden = self.model(ids, pos, meta)
        # every rank holds the whole hidden state (the residual stream is all-reduced, the final norm replicated):
        # rank 0 pools its own
        pooled = self.pool(hidden, batch) if batch.pooling_spans and self.tp.is_first else None
        if pooled is not None and self.classifies:
            pooled = self.model.classify(pooled)
        logits = self.model.compute_logits(hidden[logits_indices]) if len(logits_indices) else None
        return logits, pooled, (ids, pos, meta, hidden)

    def _encode(self, batch: StepBatch):
        """An encoder's step: every row a whole prompt (positions from 0), attended both ways within itself; its
        pooled rows (a classifier's logits); no logits to sample."""
        lens = torch.tensor(batch.num_new_tokens)
        row_seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
        pos = torch.arange(len(row_seq)) - (torch.cumsum(lens, 0) - lens)[row_seq]
        if batch.token_type_starts:
            starts = torch.tensor(batch.token_type_starts)[row_seq]
            types = ((starts >= 0) & (pos >= starts)).long()
        else:
            types = torch.zeros_like(pos)
        ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)
        pos, types = pos.to(self.device), types.to(self.device)
        hidden = self.model(ids, pos, types, batch.num_new_tokens)
        pooled = self.pool(hidden, batch) if batch.pooling_spans else None
        if pooled is not None and self.classifies:
            pooled = self.model.classify(pooled)
        return None, pooled, (ids, pos, None, hidden)

    def pool(self, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """[rows with a pooling span, hidden size] float32: the sum of each span's final hidden states (the model's
        output: after its last norm, before the LM head). Rows lie in the flat batch as laid out by prepare_inputs
        (the padding of a compiled bucket comes after every row of a decode-only step, so it shifts none)."""
        offsets, counts = (torch.tensor(x, dtype=torch.long) for x in zip(*batch.pooling_spans))
        lens = torch.tensor(batch.num_new_tokens, dtype=torch.long)
        pooling = counts > 0
        first = (torch.cumsum(lens, 0) - lens + offsets)[pooling]     # each span's first position in the flat batch
        counts = counts[pooling]
        owner = torch.repeat_interleave(torch.arange(len(counts)), counts)
        positions = first[owner] + torch.arange(len(owner)) - (torch.cumsum(counts, 0) - counts)[owner]
        sums = torch.zeros(len(counts), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        return sums.index_add_(0, owner.to(hidden.device), hidden[positions.to(hidden.device)].float())

    @torch.inference_mode()
    def execute(self, step: ModelStep) -> SampledTokens:
        """Rank 0: the forward, then one sampled token per sampling row (and the prompt logprobs asked for, the
        pooled hidden states of the pooling rows); with an MTP drafter, its pass over the step and the drafts to
        follow each sampled token."""
        logits, pooled, rows = self._forward(step.batch)
        sampled = SampledTokens([], []) if logits is None else self._sample(logits, step)
        if self.mtp_drafter is not None:
            drafts = self.mtp_drafter.draft(step.batch, *rows, sampled.token_ids)
            if drafts:
                sampled = dataclasses.replace(sampled, draft_token_ids=drafts)
        if self.kernel_pool:
            ops.quiesce()        # no pool worker reads this step's memory after it (thread_pool.c)
        return sampled if pooled is None else dataclasses.replace(sampled, pooled=pooled.tolist())

    def _sample(self, logits: torch.Tensor, step: ModelStep) -> SampledTokens:
        num_sampling = len(step.sampling)
        prompt = prompt_logprobs(logits[num_sampling:], step.prompt_logprobs) if step.prompt_logprobs else []
        logits = logits[:num_sampling]
        try:
            sampled = self.sampler(logits, step.sampling) if num_sampling else SampledTokens([], [])
        except Exception:  # noqa: BLE001 - find the rows at fault: they fail alone, the others get their token
            log.exception("batched sampling failed; sampling row by row")
            sampled = self._sample_rows_alone(logits, step)
        return dataclasses.replace(sampled, prompt_logprobs=prompt) if prompt else sampled

    def _sample_rows_alone(self, logits: torch.Tensor, step: ModelStep) -> SampledTokens:
        tokens, logprobs, errors = [], [], {}
        for i, row in enumerate(step.sampling):
            try:
                one = self.sampler(logits[i:i + 1], [row])
                tokens.append(one.token_ids[0])
                logprobs.append(one.logprobs[0])
            except Exception as e:  # noqa: BLE001
                tokens.append(0)
                logprobs.append(None)
                errors[i] = f"sampling failed: {type(e).__name__}: {e}"
        return SampledTokens(tokens, logprobs, errors)
