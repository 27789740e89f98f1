"""How many tokens, and how many requests of max_model_len, one engine's KV cache holds, as vLLM reckons them
(`get_kv_cache_capacity` in vllm/v1/core/kv_cache_utils.py): its boot log line and the `kv_cache_size_tokens` /
`kv_cache_max_concurrency` labels of `vllm:cache_config_info` say these two numbers.

kvflow's cache is one group of full-attention blocks (a sliding-window layer keeps every block too), so a request
of max_model_len tokens holds cdiv(max_model_len, block_size) blocks, the concurrency is the blocks over that, and
the size in tokens is the concurrency times max_model_len, truncated. That is blocks x block_size exactly when
max_model_len is a multiple of block_size; otherwise a little less, because a request's last block is only part
full."""
from __future__ import annotations


def kv_cache_capacity(num_blocks: int, block_size: int, max_model_len: int,
                      num_state_slots: int | None = None) -> tuple[int, float]:
    """(size in tokens, maximum concurrency at max_model_len tokens per request) of one engine's KV cache; a hybrid's
    requests also each need one of `num_state_slots` live state slots, which may bound the concurrency first."""
    blocks_per_request = -(-max_model_len // block_size)
    max_concurrency = num_blocks / blocks_per_request
    if num_state_slots is not None:
        max_concurrency = min(max_concurrency, float(num_state_slots))
    return int(max_concurrency * max_model_len), max_concurrency
