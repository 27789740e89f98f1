"""transformers' greedy choices as the token-exact reference, by teacher forcing: one forward over the prompt and
kvflow's tokens gives transformers' argmax at every generated position at once. The sequences are equal exactly when
transformers' own step-by-step greedy generation gives kvflow's tokens (each step's context is then the same), and
the first position where they differ is where transformers' generation would leave kvflow's — at a fraction of
`generate`'s cost (one prefill instead of one per token, and logits for the generated positions only)."""
from __future__ import annotations

import torch


@torch.inference_mode()
def greedy_choices(model, prompt_ids: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy token at each position of `tokens`, given the prompt and `tokens` before it."""
    if not tokens:
        return []
    ids = torch.tensor([list(prompt_ids) + list(tokens[:-1])], device=model.device)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=len(tokens),
                   use_cache=False).logits
    return logits[0].argmax(-1).tolist()


def assert_greedy_matches(model, prompt_ids: list[int], tokens: list[int], what: str = "",
                          length: int | None = None) -> None:
    """kvflow's greedy `tokens` are transformers' greedy generation after `prompt_ids`, token for token (for tokens
    that end at an end-of-sequence token, up to it: transformers would stop there too). `length`: how many tokens
    kvflow had to give (max_tokens with ignore_eos)."""
    assert length is None or len(tokens) == length, f"{what}kvflow gave {len(tokens)} tokens, not {length}"
    want = greedy_choices(model, prompt_ids, tokens)
    assert tokens == want, (f"{what}prompt of {len(prompt_ids)} tokens: kvflow {tokens} != transformers' choices "
                            f"{want} (transformers' generation leaves kvflow's at the first difference)")
