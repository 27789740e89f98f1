"""EngineCore: the step loop's one body. Token ids in, token ids out; no text, no threads.

    step():  Scheduler.schedule() -> ModelStep -> executor.execute() -> SampledTokens -> Scheduler.update()
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import Iterable

from kvflow import platform
from kvflow.config import EngineConfig
from kvflow.core.kv_cache_capacity import kv_cache_capacity
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.lora_slots import LoRASlots
from kvflow.core.outputs import EngineOutput, ScheduledRequest, StepStats
from kvflow.core.request_validator import RequestValidator
from kvflow.core.scheduler import Scheduler
from kvflow.core.state_cache import StateCache
from kvflow.executor import create_executor
from kvflow.models.model_files import ModelFiles, resolve_model_files
from kvflow.lora_request import LoRARequest
from kvflow.request import AddRequest, Request

log = logging.getLogger("kvflow")

# what a sleeping engine has let go of, by vLLM's tag names (`wake_up(tags)` brings back those named)
SLEEP_TAGS = ("weights", "kv_cache")


class EngineCore:
    # what the frontend may call in the engine process between steps (`EngineProcess.call`): checks and numbers
    UTILITY_METHODS = frozenset({"check", "has_unfinished_requests", "worker_pids", "counters", "kv_block_map",
                                 "lora_state", "sleep_state"})

    def __init__(self, config: EngineConfig, eos_token_ids: Iterable[int] | None = None,
                 files: ModelFiles | None = None):
        """`files`: the model resolved once by the caller (its tokenizer came from the same parse)."""
        self.config = config
        files = files or resolve_model_files(config.model, config.tokenizer, config.hf_overrides)
        self.files = files
        self.model_path = files.path
        self.model_config = files.config
        model_len = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"max_model_len={config.max_model_len} is larger than the model's context "
                             f"length ({model_len})")
        self.max_model_len = config.max_model_len or self.model_config.max_model_len
        mc = self.model_config
        self.pooling = mc.pooling_for(config.pooling)      # --pooling, else the model's own, else its family's
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None
                                       else self.model_config.eos_token_ids)
        self.validator = RequestValidator(mc.vocab_size, self.max_model_len, mc.tasks, mc.architecture)
        self.executor = create_executor(config, self.model_config, files, self.max_model_len)
        self.runner = self.executor.runner            # rank 0's: weights, KV cache sizes, dtype
        state = (StateCache(self.runner.state_slots, self.runner.kv_cache_bytes)
                 if self.runner.state_slots is not None else None)
        # an encoder keeps no KV across steps: its blocks are bookkeeping only, nothing to reuse
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.block_size,
                                               config.enable_prefix_caching and not mc.encoder_only, state)
        self.lora_slots = LoRASlots(config.max_loras, config.lora_cpu_capacity, self._read_adapter) \
            if config.enable_lora else None
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.max_model_len, self.lora_slots,
                                   pooling=self.pooling, whole_prompts=mc.encoder_only)
        self._aborted_outputs: list[EngineOutput] = []
        # as of the last stats: preemptions, prefix-cache queries, hits, then speculative decoding's drafts, draft
        # tokens, accepted tokens and accepted per position
        self._counters = (0,) * (6 + self.scheduler.spec_k)
        self.num_prompt_tokens_computed = 0    # since start: prompt tokens not served by the prefix cache
        self.last_stats = StepStats()
        # sleep mode: the level slept at (0: awake) and the tags still asleep; the config that loads the weights
        # again with the KV budget they had (the same blocks and state slots: the books above keep those numbers)
        self.sleep_level = 0
        self.sleeping: set[str] = set()
        self._reload_config = (config if self.runner.encoder
                               else dataclasses.replace(config, kv_cache_memory=self.runner.kv_budget))
        self._log_boot()

    def _log_boot(self) -> None:
        r = self.runner
        tokens, max_concurrency = kv_cache_capacity(r.num_blocks, self.config.block_size, self.max_model_len,
                                                    r.state_slots.live if r.state_slots is not None else None)
        log.info("model %s (%s) on %s, %s", self.model_path, self.model_config.family, r.device,
                 str(r.dtype).removeprefix("torch."))
        log.info("weights loaded in %.1f s (%.0f MiB, %s)", r.load_seconds, r.weights_bytes / 2**20,
                 r.quantization or "not quantized")
        if self.config.tensor_parallel_size > 1:
            log.info("tensor parallel: %d ranks; rank 0 holds %d of %d KV heads and %d of %d vocabulary rows "
                     "(sizes below are rank 0's)", self.config.tensor_parallel_size, r.model.sizes.num_kv_heads,
                     self.model_config.num_key_value_heads, r.model.sizes.vocab_size, self.model_config.vocab_size)
        if r.encoder:
            log.info("no KV cache (an encoder: each prompt computed whole in one step, up to %d running at once; "
                     "pooling %s)", self.config.max_num_seqs, self.pooling)
            return
        # vLLM's figures (its "GPU KV cache size" line), which vllm:cache_config_info's labels repeat
        log.info("KV cache %.2f GiB (%s) = %d blocks of %d tokens; KV cache size: %s tokens, maximum concurrency "
                 "for max_model_len=%s tokens per request: %.2fx", r.kv_cache_bytes / 2**30,
                 str(r.kv_dtype).removeprefix("torch."), r.num_blocks, self.config.block_size, f"{tokens:,}",
                 f"{self.max_model_len:,}", max_concurrency)
        slots = r.state_slots
        if slots is not None:
            log.info("recurrent state %.2f GiB (%d layers, %.2f MiB per request) = %d live slots (as many requests run "
                     "at once), %d speculative snapshots, %d prefix-cache checkpoints",
                     slots.total * slots.slot_bytes / 2**30, len(r.state_layers), slots.slot_bytes / 2**20, slots.live,
                     slots.snapshots, slots.checkpoints)

    def _read_adapter(self, lora: LoRARequest):
        from kvflow.models.lora_adapter import load_adapter
        return load_adapter(lora.lora_path, self.model_config, self.config.max_lora_rank, lora.lora_name,
                            self.config.lora_target_modules)

    @property
    def requests(self) -> dict[str, Request]:
        return self.scheduler.requests

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request: AddRequest) -> None:
        """Queue a request, n = 1 (the frontend fans out n > 1). Its `max_tokens` resolved means the frontend's
        `RequestValidator.admit` checked it (the frontends do: it is not checked twice); without it the core checks
        the request itself and raises InvalidRequestError before anything is queued. A LoRA adapter it names is read
        from its path when it first needs a slot (enable_lora)."""
        if self.sleeping:
            raise RuntimeError("the engine is sleeping: wake_up() first")
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.params.n != 1:
            raise ValueError("the engine core takes n=1 requests; fan out n>1 before add_request")
        if request.lora is not None and self.lora_slots is None:
            raise ValueError(f"request {request.request_id!r} names LoRA adapter {request.lora.lora_name!r}, but LoRA "
                             "is off (enable_lora)")
        if request.max_tokens is None:
            request = dataclasses.replace(request, max_tokens=self.validator.validate(
                request.prompt_token_ids, request.params, request.pooling))
        self.scheduler.add_request(Request.from_add_request(request, self.eos_token_ids))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Free unfinished requests' blocks now; their final outputs (finish_reason "abort") come next step."""
        self._aborted_outputs += self.scheduler.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests) or bool(self._aborted_outputs)

    def check_health(self) -> None:
        """Raise if the engine cannot step any more (a tensor-parallel worker died). Cheap; for idle loops."""
        if self.executor is not None:
            self.executor.check_health()

    def check(self) -> None:
        """Raise AssertionError if the KV cache manager's books do not balance (for tests, between steps)."""
        self.kv_cache_manager.check()
        if self.lora_slots is not None:
            self.lora_slots.check()

    def lora_state(self) -> dict:
        """The LoRA slots (adapter names per slot), the adapters read in memory, loads and swaps so far."""
        ls = self.lora_slots
        if ls is None:
            return {}
        return {"slots": list(ls.slots), "cpu": list(ls.cpu), "num_loads": ls.num_loads, "num_swaps": ls.num_swaps}

    def worker_pids(self) -> list[int]:
        """The tensor-parallel worker processes' pids (none with one rank)."""
        return [proc.pid for _placement, proc in getattr(self.executor, "workers", [])]

    def counters(self) -> dict[str, int]:
        """Totals since start."""
        return {"num_preemptions": self.scheduler.num_preemptions,
                "num_prompt_tokens_computed": self.num_prompt_tokens_computed}

    def kv_block_map(self) -> tuple[bytes, float]:
        """One byte per KV block: 0 free, 1 free but holding a prefix-cache entry, 2 held by one request, 3 shared
        by several (the dashboard asks for it, about once a second while a page is open: O(blocks)); and the
        seconds it took here, between steps (what the dashboard's view costs the engine)."""
        t0 = time.perf_counter()
        kv = self.kv_cache_manager
        blocks = bytes((2 if c == 1 else 3) if c else (0 if k is None else 1)
                       for c, k in zip(kv.ref_cnt, kv.block_key))
        return blocks, time.perf_counter() - t0

    def load_compiled_steps(self) -> bool:
        """While idle: load the decode graphs compiled in the background since the last step; True when one
        was (a step loads them too)."""
        return self.runner.load_compiled_steps() if self.runner is not None else False

    # ---- sleep mode ----------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep, on this machine's memory: level 1 drops the KV cache (and a hybrid's recurrent state) and
        keeps the weights; level 2 drops the weights too (they load again from the model's files). Prefix-cache
        entries are forgotten. Only with no request unfinished (the engine loop drains them first)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.has_unfinished_requests():
            raise RuntimeError("requests are unfinished: the engine sleeps once they are done")
        self.kv_cache_manager.reset_prefix_cache()
        if self.runner is not None:
            self.runner.release_kv_cache()
        if level == 2 and self.executor is not None:
            self.executor.shutdown()
            self.executor = self.runner = None
            gc.collect()                  # the model's modules refer to one another
            platform.release_freed_memory()
        self.sleeping = set(SLEEP_TAGS)
        self.sleep_level = max(self.sleep_level, level)
        log.info("sleeping (level %d): %s released", level, "KV cache and weights" if level == 2 else "KV cache")

    def wake_up(self, tags: Iterable[str] | None = None) -> bool:
        """Bring back what `tags` name (vLLM's: "weights", "kv_cache"; None: everything asleep): the weights from
        the model's files, the KV cache (and state slots) as planned at load. True when nothing sleeps any more."""
        tags = set(SLEEP_TAGS if tags is None else tags)
        unknown = tags - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"unknown wake_up tag(s) {', '.join(sorted(unknown))}: the tags are "
                             f"{', '.join(SLEEP_TAGS)}")
        if not self.sleeping & tags:
            return not self.sleeping
        t0 = time.perf_counter()
        if "weights" in tags and self.executor is None:
            self._load_weights()
        self.sleeping -= tags
        if self.runner is not None:
            if "kv_cache" in self.sleeping:
                self.runner.release_kv_cache()      # a reload allocates it: not wanted yet
            else:
                self.runner.restore_kv_cache()
        if not self.sleeping:
            self.sleep_level = 0
        log.info("woke %s in %.2f s%s", " and ".join(sorted(tags)), time.perf_counter() - t0,
                 f" ({', '.join(sorted(self.sleeping))} still asleep)" if self.sleeping else "")
        return not self.sleeping

    def _load_weights(self) -> None:
        """A new executor over the model's files, with the KV budget of the first load."""
        self.executor = create_executor(self._reload_config, self.model_config, self.files, self.max_model_len)
        self.runner = self.executor.runner
        if self.runner.num_blocks != self.kv_cache_manager.num_blocks:
            raise RuntimeError(f"the reloaded model plans {self.runner.num_blocks} KV blocks, not "
                               f"{self.kv_cache_manager.num_blocks}")
        if self.lora_slots is not None:     # the new model's slots are empty
            self.lora_slots.forget_slots()

    def sleep_state(self) -> dict:
        """The level slept at (0: awake) and the tags still asleep."""
        return {"level": self.sleep_level, "sleeping": sorted(self.sleeping)}

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any. Call once no step is running."""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        outputs, self._aborted_outputs = self._aborted_outputs, []
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if self.scheduler.failed:
            outputs += self.scheduler.failed
            self.scheduler.failed = []
        if not sched.scheduled:
            self.last_stats = self._stats()
            return outputs
        requests = self.requests
        num_prompt = sum(max(0, min(s.num_new_tokens, requests[s.request_id].num_prompt_tokens - s.num_computed_tokens))
                         for s in sched.scheduled)
        self.num_prompt_tokens_computed += num_prompt
        # vLLM's iteration_tokens_total (IterationStats: num_prompt_tokens + num_generation_tokens) counts the
        # whole prompt (cached tokens too) of each request in the step of its first output, and every token
        # sampled: not the chunk tokens the model computed. These requests have their first output now:
        first_output = {s.request_id for s in sched.scheduled if self._first_output(requests[s.request_id], s)}
        if self.lora_slots is not None:     # adapters that took a slot this step: in place before the forward
            for slot, weights in self.lora_slots.take_swaps():
                self.executor.set_lora_slot(slot, weights)
        sampled = self.executor.execute(sched.step)
        step_outputs = self.scheduler.update(sched, sampled)
        outputs += step_outputs
        iteration_tokens = sum(len(o.new_token_ids) + (o.num_prompt_tokens if o.request_id in first_output else 0)
                               for o in step_outputs) if step_outputs else None
        self.last_stats = self._stats(batch_size=len(sched.scheduled), num_batched_tokens=sched.num_batched_tokens,
                                      iteration_tokens=iteration_tokens, num_prompt_tokens_computed=num_prompt,
                                      num_generated_tokens=sum(len(o.new_token_ids) for o in step_outputs),
                                      duration_s=time.perf_counter() - t0)
        return outputs

    @staticmethod
    def _first_output(req: Request, s: ScheduledRequest) -> bool:
        """Whether this step gives the request its first output: its first token, or (an embedding request, whose
        one result is its vector) its last chunk."""
        if req.pooling is not None:
            return s.num_computed_tokens + s.num_new_tokens == req.num_prompt_tokens
        return s.samples and req.num_output_tokens == 0

    def stats(self) -> StepStats:
        """The engine as it is now, with the counters' deltas since the last stats (for an idle look)."""
        self.last_stats = self._stats()
        return self.last_stats

    def _stats(self, **step) -> StepStats:
        kv, sched = self.kv_cache_manager, self.scheduler
        counters = (sched.num_preemptions, kv.prefix_cache_queries, kv.prefix_cache_hits, sched.spec_num_drafts,
                    sched.spec_num_draft_tokens, sched.spec_num_accepted_tokens, *sched.spec_accepted_per_pos)
        deltas = [now - before for now, before in zip(counters, self._counters)]
        self._counters = counters
        compiled = self.runner.compiled_decode if self.runner is not None else None
        lora = {}
        if self.lora_slots is not None:
            running, waiting = sched.lora_adapters()
            lora = {"max_lora": self.config.max_loras, "lora_running": tuple(running), "lora_waiting": tuple(waiting)}
        return StepStats(**lora, num_running=len(sched.running), num_waiting=len(sched.waiting),
                         kv_cache_usage=kv.usage, num_preemptions=deltas[0], prefix_cache_queries=deltas[1],
                         prefix_cache_hits=deltas[2], spec_num_drafts=deltas[3], spec_num_draft_tokens=deltas[4],
                         spec_num_accepted_tokens=deltas[5], spec_accepted_per_pos=tuple(deltas[6:]),
                         compiled_decode_buckets_ready=len(compiled.ready) if compiled and not compiled.failed else 0,
                         compiled_decode_buckets_total=len(compiled.buckets) if compiled else 0, **step)
