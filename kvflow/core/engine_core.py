"""EngineCore: the step loop's one body. Token ids in, token ids out; no text, no threads."""
from __future__ import annotations

import logging
import time
from typing import Iterable

from kvflow.config import EngineConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.outputs import EngineOutput
from kvflow.core.scheduler import Scheduler
from kvflow.models.loader import load_model_config, resolve_model_path
from kvflow.request import Request
from kvflow.runner.model_runner import ModelRunner
from kvflow.sampling_params import SamplingParams

log = logging.getLogger("kvflow")


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_ids: Iterable[int] | None = None):
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config = load_model_config(self.model_path)
        model_len = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"max_model_len={config.max_model_len} is larger than the model's context "
                             f"length ({model_len})")
        self.max_model_len = config.max_model_len or model_len
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None
                                       else self.model_config.eos_token_ids)

        # tensor parallelism: this process is rank 0; the executor starts the other ranks and sends them
        # each step. The split is checked first, before any process starts.
        self.workers = None
        if config.tensor_parallel_size > 1:
            from kvflow.distributed.executor import TensorParallelExecutor
            from kvflow.models.llama import check_tensor_parallel
            check_tensor_parallel(self.model_config, config.tensor_parallel_size)
            self.workers = TensorParallelExecutor(config, self.max_model_len)
        try:
            self.runner = ModelRunner(config, self.model_config, self.model_path, self.max_model_len,
                                      tp=self.workers.tp if self.workers else None, workers=self.workers)
        except BaseException:
            self.shutdown()
            raise
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.block_size,
                                               config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._aborted_outputs: list[EngineOutput] = []
        self.num_prompt_tokens_computed = 0
        self.last_step = {"batch_size": 0, "num_tokens": 0, "duration_s": 0.0}
        self._log_boot()

    def _log_boot(self) -> None:
        r = self.runner
        tokens = r.num_blocks * self.config.block_size
        log.info("model %s (%s) on %s, %s", self.model_path, self.model_config.family, r.device,
                 str(r.dtype).removeprefix("torch."))
        log.info("weights loaded in %.1f s (%.0f MiB, %s)", r.load_seconds, r.weights_bytes / 2**20,
                 self.config.quantization if self.config.quantization not in (None, "none") else "not quantized")
        if self.workers is not None:
            log.info("tensor parallel: %d ranks; rank 0 holds %d of %d KV heads and %d of %d vocabulary rows "
                     "(sizes below are rank 0's)", self.config.tensor_parallel_size, r.model.sizes.num_kv_heads,
                     self.model_config.num_key_value_heads, r.model.sizes.vocab_size, self.model_config.vocab_size)
        log.info("KV cache %.2f GiB (%s) = %d blocks = %d tokens; maximum concurrency at max_model_len=%d: %.1fx",
                 r.kv_cache_bytes / 2**30, str(r.kv_dtype).removeprefix("torch."), r.num_blocks, tokens,
                 self.max_model_len, tokens / self.max_model_len)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError("the engine core takes n=1 requests; fan out n>1 before add_request")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, which leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) is {n + max_tokens} "
                             f"tokens, more than max_model_len={self.max_model_len}")
        req = Request(request_id, prompt_token_ids, params, max_tokens, arrival_time)
        req.eos_token_ids = self.eos_token_ids
        self.requests[request_id] = req
        self.scheduler.add_request(req)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Free an unfinished request's blocks now; its final output (finish_reason "abort") comes next step."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self.scheduler.abort(req)
            self._aborted_outputs.append(EngineOutput(rid, [], finish_reason="abort",
                                                      num_prompt_tokens=req.num_prompt_tokens,
                                                      num_cached_tokens=req.num_cached_tokens))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted_outputs)

    def check_health(self) -> None:
        """Raise if the engine cannot step any more (a tensor-parallel worker died). Cheap; for idle loops."""
        if self.workers is not None:
            self.workers.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any. Call once no step is running."""
        if self.workers is not None:
            self.workers.shutdown()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        outputs, self._aborted_outputs = self._aborted_outputs, []
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        for s in sched.scheduled:
            if s.num_computed_tokens < self.requests[s.request_id].num_prompt_tokens:
                self.num_prompt_tokens_computed += min(
                    s.num_new_tokens, self.requests[s.request_id].num_prompt_tokens - s.num_computed_tokens)
        sampled, logprobs = self.runner.execute(sched, self.requests, self.kv_cache_manager.block_tables)
        self.scheduler.update(sched, self.requests, sampled)
        for rid, token in sampled.items():
            req = self.requests[rid]
            lp = logprobs.get(rid)
            outputs.append(EngineOutput(
                rid, [token], new_logprobs=[lp] if lp is not None else None,
                finish_reason=req.finish_reason, stop_reason=req.stop_reason,
                num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens))
            if req.status.finished:
                del self.requests[rid]
        self.last_step = {"batch_size": len(sched.scheduled), "num_tokens": sched.num_batched_tokens,
                          "duration_s": time.perf_counter() - t0}
        return outputs

    def stats(self) -> dict:
        kv = self.kv_cache_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": kv.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_prompt_tokens_computed": self.num_prompt_tokens_computed,
            "last_step_batch_size": self.last_step["batch_size"],
            "last_step_num_tokens": self.last_step["num_tokens"],
            "last_step_duration_s": self.last_step["duration_s"],
            "weights_bytes": self.runner.weights_bytes,
            "kv_cache_bytes": self.runner.kv_cache_bytes,
            "num_kv_blocks": self.runner.num_blocks,
        }
