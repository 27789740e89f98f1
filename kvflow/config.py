"""EngineConfig: every engine setting, built once, validated, frozen."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from kvflow.speculative_config import SpeculativeConfig

SCHEDULING_POLICIES = ("continuous", "fcfs", "priority", "static")
DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = (None, "none", "fp8", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "int8")
POOLING_TYPES = (None, "last", "mean", "cls")     # kvflow/pooling_params.py says what each computes
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
# the projections a LoRA adapter may adapt (PEFT's module names), over every family: the Llama family's seven (Qwen3.5's
# too), LFM2's attention out_proj and MLP w1/w3/w2, Granite 4.0 H's shared MLP input_linear/output_linear. A model
# refuses a name it has no such projection for (models/lora_modules.py)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                       "out_proj", "w1", "w3", "w2", "input_linear", "output_linear")


def parse_bytes(value: int | str | None) -> int | None:
    """'4GiB', '512MiB', '2G', '1000000' -> bytes."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"kv_cache_memory: cannot read {value!r} as a size (examples: 4GiB, 512MiB, 1000000)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if (binary or unit) else 1   # '4G' means GiB, as most users mean it
    power = " KMGT".index(unit) if unit else 0
    return int(number * base ** power)


def parse_init_method(init_method: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' (HOST may be [IPv6]) -> (HOST, PORT)."""
    m = re.fullmatch(r"tcp://(\[[^\]]+\]|[^:/\[\]]+):(\d+)/?", init_method or "")
    if not m:
        raise ValueError(f"distributed_init_method must look like tcp://HOST:PORT, got {init_method!r}")
    return m.group(1).strip("[]"), int(m.group(2))


def _option(default, help: str, **cli):
    """A field with its `kvflow serve` flag's help text (and optional aliases, metavar, argparse type)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = _option(None, "HF model folder or GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = _option(None, "tokenizer folder (default: the model's)")
    served_model_name: str | None = _option(None, "the model name the API answers to (default: the model argument)")
    dtype: str = _option("auto", "auto, bfloat16, float16 or float32; auto: bfloat16 where the CPU/GPU does it fast, "
                                 "else float32")
    device: str = _option("auto", "auto, cpu or cuda[:N]; auto: cuda when available, else cpu")
    max_model_len: int | None = _option(None, "context length in tokens (default: the model's own)")
    block_size: int = _option(16, "tokens per KV cache block (a power of two)")
    kv_cache_memory: int | None = _option(None, "bytes for the KV cache, e.g. 4GiB; wins over "
                                                "gpu_memory_utilization", type=str)
    gpu_memory_utilization: float | None = _option(None, "fraction of device memory (RAM on CPU) for weights "
                                                         "+ KV cache")
    max_num_seqs: int = _option(128, "most requests running in one step")
    max_num_batched_tokens: int = _option(1024, "token budget of one step; longer prompts are prefilled in chunks")
    max_prefill_tokens_while_decoding: int = _option(0, "while requests are generating, prefill at most this many "
                                                        "prompt tokens per step, so their streams do not stall behind "
                                                        "a long prompt (0: no cap; see docs/performance.md)")
    max_background_seqs: int = _option(2, "while requests of the lowest priority value run (or ran within the last "
                                          "second), requests of higher values (the Batch API's lines) take at most "
                                          "this many rows of a step: a step stays as short as the interactive "
                                          "requests' own, so their latency holds (see docs/performance.md)")
    max_background_tokens: int = _option(16, "tokens a step gives requests of a priority value above 0 (the Batch "
                                            "API's lines) at all times: a step made of background work stays "
                                            "short, so an interactive request that arrives during it waits "
                                            "little (0: no cap; see docs/performance.md)")
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of a shared prompt prefix")
    scheduling_policy: str = _option("continuous", "continuous (= vLLM's fcfs; the Batch API's lines still run after "
                                                   "interactive requests), priority (as continuous, and requests may "
                                                   "set their own priority: a lower value first, as vLLM), or static "
                                                   "(admit a batch, run it to the end) for A/B benchmarks")
    quantization: str | None = _option(
        None, "weights: unset keeps a quantized GGUF's own codes on CPU; none (float), int4 (group 32), int8 or "
              "fp8 (per-channel scales)", aliases=("-q",))
    kv_cache_dtype: str = _option("auto", "auto (the compute dtype; 16 bits on a CPU computing in float32 under "
                                  "dtype=auto), bfloat16, float16, float32, fp8 (float8 e4m3, unscaled) or int8 "
                                  "(codes with a scale per token and head)")
    tensor_parallel_size: int = _option(1, "split the model over N processes (gloo on CPU, NCCL on CUDA, one GPU "
                                           "each)", aliases=("-tp",))
    data_parallel_size: int = _option(1, "engine processes behind the one HTTP frontend, each with its own copy of "
                                         "the model and a share of the KV cache and the cores; a request goes to "
                                         "the engine most likely holding its prompt's prefix, then the least "
                                         "loaded", aliases=("-dp",))
    distributed_executor_backend: str = _option(
        "mp", "how tensor-parallel ranks start: mp (processes this engine spawns on this machine) or ray (Ray actors "
              "in a placement group on the Ray cluster at RAY_ADDRESS, else one on this machine: STRICT_PACK keeps "
              "them on this node, VLLM_RAY_PG_STRATEGY=SPREAD spreads them over the nodes; needs kvflow[ray])",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS)
    distributed_init_method: str | None = _option(None, "rendezvous of a multi-machine run: tcp://HOST:PORT of node "
                                                        "0, which every node can reach (default: one machine, a free "
                                                        "local port)", metavar="tcp://HOST:PORT")
    nnodes: int = _option(1, "machines; each runs tensor_parallel_size / nnodes ranks")
    node_rank: int = _option(0, "this machine's index; node 0 runs the scheduler and serves HTTP, the others only run "
                                "their ranks")
    seed: int = _option(0, "seed of the engine's default random generator (requests without a seed)")
    speculative_config: SpeculativeConfig | None = _option(
        None, 'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_max": 4, "prompt_lookup_min": 1}, {"method": "suffix", ...} or {"method": "mtp", '
              '"num_speculative_tokens": 2} (Qwen3.5\'s own multi-token-prediction head); '
              '"disable_by_batch_size": N stops it above N running requests (kvflow/speculative_config.py)',
        type=str, metavar="JSON")
    hf_overrides: dict | None = _option(
        None, 'config.json keys to override, vLLM\'s JSON, e.g. a decoder reranker scored by two tokens\' logits: '
              '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
              '"is_original_qwen3_reranker": true}', type=str, metavar="JSON")
    pooling: str | None = _option(None, "how /v1/embeddings and LLM.embed pool a prompt's final hidden states (after "
                                        "the model's last norm): last (the last token's), mean (over every prompt "
                                        "token) or cls (the first token's); unset: the model's own "
                                        "(sentence-transformers' 1_Pooling/config.json), else last for a decoder, "
                                        "cls for a BERT", choices=POOLING_TYPES[1:])
    enforce_eager: bool = _option(os.environ.get("KVFLOW_ENFORCE_EAGER", "") == "1",
                                  "run every step eagerly: no torch.compile'd decode steps (the default compiles "
                                  "decode-only steps on CPU in the background and serves eagerly until each batch "
                                  "size bucket is ready; environment KVFLOW_ENFORCE_EAGER=1 flips the default)")
    enable_sleep_mode: bool = _option(False, "vLLM's sleep mode: POST /sleep?level=1 drops the KV cache (and a "
                                             "hybrid's recurrent state), level=2 the weights too, POST /wake_up "
                                             "loads them again, GET /is_sleeping; LLM.sleep() / LLM.wake_up() "
                                             "offline (without it those routes answer 404)")
    small_step_threads: int | None = _option(
        None, "CPU threads for steps of <= 8 rows. Where kvflow's kernels run the step (4-bit weights on CPU) they "
              "take them on kvflow's thread pool (unset: every thread; a preempted thread delays nobody there) and "
              "torch's few ops take one; elsewhere torch's kernels take them (unset: every thread, except in a "
              "server, which leaves one core to its HTTP frontend: their many short parallel regions otherwise wait "
              "on it)")
    enable_lora: bool = _option(False, "serve LoRA adapters (PEFT format) beside the base model: --lora-modules at "
                                       "start, /v1/load_lora_adapter at run time (with "
                                       "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true); a request picks one by its model name")
    max_loras: int = _option(1, "adapters resident at once (slots in the model): one step mixes requests of up to "
                                "this many adapters and the base; more wait their turn (LRU swap at a step boundary)")
    max_lora_rank: int = _option(16, "largest adapter rank accepted; every slot is this wide (smaller ranks are "
                                     "zero-padded)")
    max_cpu_loras: int | None = _option(None, "adapters kept read in memory (LRU; an evicted one is read again "
                                              "from its path when needed; default: max_loras)")
    lora_target_modules: tuple[str, ...] | None = _option(
        None, "the projections LoRA slots exist for, by their checkpoint names (default: every attention and MLP "
              "projection: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj on Llama-like models; LFM2's "
              "out_proj w1 w3 w2, Granite 4.0 H's input_linear output_linear); fewer cost less per step, and an "
              "adapter adapting others is refused",
        type=str, nargs="+")
    compile_batch_sizes: tuple[int, ...] = _option((1, 2, 4, 8, 16, 32), "batch-size buckets of the compiled decode "
                                                   "step, compiled smallest first; a decode step is padded to the next "
                                                   "bucket, larger steps run eagerly", type=int, nargs="+")

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if isinstance(self.hf_overrides, str):
            try:
                object.__setattr__(self, "hf_overrides", json.loads(self.hf_overrides))
            except json.JSONDecodeError as e:
                raise ValueError(f"hf_overrides must be a JSON object: {e}") from None
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a JSON object, got {self.hf_overrides!r}")
        object.__setattr__(self, "compile_batch_sizes", tuple(sorted({int(b) for b in self.compile_batch_sizes})))
        if self.lora_target_modules is not None:
            given = self.lora_target_modules
            given = given.replace(",", " ").split() if isinstance(given, str) else given
            # in one order whatever the order given (it keys the compiled graphs); unknown names kept for validate
            object.__setattr__(self, "lora_target_modules", tuple(t for t in LORA_TARGET_MODULES if t in given)
                               + tuple(t for t in given if t not in LORA_TARGET_MODULES))
        self.validate()

    def validate(self) -> None:
        for name, choices in (("dtype", DTYPES), ("scheduling_policy", SCHEDULING_POLICIES),
                              ("quantization", QUANTIZATIONS), ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("pooling", POOLING_TYPES),
                              ("distributed_executor_backend", DISTRIBUTED_EXECUTOR_BACKENDS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(c for c in choices if c)}, "
                                 f"got {getattr(self, name)!r}")
        for name, least in (("max_model_len", 1), ("kv_cache_memory", 1), ("max_num_seqs", 1),
                            ("max_num_batched_tokens", 1), ("max_prefill_tokens_while_decoding", 0),
                            ("max_background_seqs", 0),
                            ("max_background_tokens", 0),
                            ("tensor_parallel_size", 1), ("data_parallel_size", 1), ("nnodes", 1),
                            ("small_step_threads", 1), ("max_loras", 1), ("max_lora_rank", 1),
                            ("max_cpu_loras", 1)):
            if getattr(self, name) is not None and getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if not (self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if any(b < 1 for b in self.compile_batch_sizes):
            raise ValueError(f"compile_batch_sizes must be >= 1, got {self.compile_batch_sizes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be a multiple of "
                             f"nnodes={self.nnodes} (every machine runs the same number of ranks)")
        if self.enable_sleep_mode and self.tensor_parallel_size > 1:
            raise ValueError("enable_sleep_mode does not run with tensor_parallel_size > 1 yet (the worker ranks "
                             "would have to drop and reload their shares too)")
        if self.data_parallel_size > 1 and (self.tensor_parallel_size > 1 or self.nnodes > 1):
            raise ValueError("data_parallel_size > 1 runs whole engines on this machine: it does not combine with "
                             "tensor_parallel_size > 1 or nnodes > 1 yet")
        if self.distributed_executor_backend == "ray":
            if self.nnodes > 1 or self.distributed_init_method is not None:
                raise ValueError("distributed_executor_backend=ray places the ranks itself: it does not combine with "
                                 "nnodes, node_rank or distributed_init_method")
            if self.data_parallel_size > 1:
                raise ValueError("distributed_executor_backend=ray runs tensor-parallel ranks only: it does not "
                                 "combine with data_parallel_size > 1 yet")
            if self.device.startswith("cuda"):
                raise ValueError("distributed_executor_backend=ray places CPU ranks only yet: use device=cpu, or "
                                 "the mp backend on GPUs")
            try:
                import ray  # noqa: F401
            except ImportError:
                raise ValueError("distributed_executor_backend=ray needs Ray, which is not installed: "
                                 "pip install 'kvflow[ray]'") from None
        if self.nnodes > 1 and self.distributed_init_method is None:
            raise ValueError("nnodes > 1 needs distributed_init_method=tcp://HOST:PORT, an address of node 0 "
                             "that every node can reach")
        if self.distributed_init_method is not None:
            parse_init_method(self.distributed_init_method)
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora does not combine with tensor_parallel_size > 1 yet: each rank would need its "
                             "slice of every adapter (serve adapters with tensor_parallel_size=1)")
        if self.lora_target_modules is not None:
            bad = [t for t in self.lora_target_modules if t not in LORA_TARGET_MODULES]
            if bad or not self.lora_target_modules:
                raise ValueError(f"lora_target_modules: {bad or 'none given'} not among {', '.join(LORA_TARGET_MODULES)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def lora_cpu_capacity(self) -> int:
        """Adapters the engine keeps read in memory (max_cpu_loras, default max_loras)."""
        return self.max_cpu_loras or self.max_loras
