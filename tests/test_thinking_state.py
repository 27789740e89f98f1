"""Where a reasoning model's answer starts, in the engine (structured_output/thinking.py): the end marker found
however many tokens it is, the prompt's own end, the budget's forced tokens, the drafts a step may verify; and the
sampler writing a forced token whatever it drew."""
import pytest
import torch

from kvflow.runner.sampler import Sampler
from kvflow.runner.step import SamplingRow
from kvflow.sampling_params import SamplingParams
from kvflow.structured_output.thinking import ThinkingSpec


def feed(state, tokens):
    return [state.accept(t) for t in tokens]


def test_the_marker_ends_the_reasoning_and_belongs_to_it():
    state = ThinkingSpec((5, 6, 7)).state()
    assert feed(state, [1, 5, 6, 1, 5, 6, 7, 8, 5]) == [False] * 7 + [True, True]
    assert not state.in_reasoning and state.thought == 6       # what came before the marker's last token


def test_without_a_message_a_begun_marker_is_finished_at_the_budget():
    state = ThinkingSpec((5, 6, 7), budget=3, forced_token_ids=(5, 6, 7)).state()
    feed(state, [1, 5, 6])
    assert state.forced_token() == 7 and feed(state, [7]) == [False] and not state.in_reasoning


def test_a_prompt_that_closed_the_reasoning_starts_in_the_answer():
    state = ThinkingSpec((5,), in_reasoning=False, budget=0, forced_token_ids=(5,)).state()
    assert state.forced_token() is None and feed(state, [1, 5]) == [True, True]


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_a_spent_budget_forces_its_tokens_then_the_answer(budget):
    spec = ThinkingSpec((5, 6), budget=budget, forced_token_ids=(9, 5, 6))
    state, out = spec.state(), []
    while state.in_reasoning:
        token = state.forced_token() if state.forced_token() is not None else 1
        out.append(token)
        state.accept(token)
    assert out == [1] * budget + [9, 5, 6] and state.thought == budget and state.accept(1)


def test_the_forced_tokens_must_end_with_the_marker():
    with pytest.raises(ValueError):
        ThinkingSpec((5, 6), budget=2, forced_token_ids=(5,))


def test_drafts_are_verified_up_to_the_end_or_the_spent_budget():
    state = ThinkingSpec((5, 6), budget=4, forced_token_ids=(5, 6)).state()
    assert state.drafts_to_verify((1, 5, 6, 1)) == 3
    assert state.drafts_to_verify((1, 1, 1, 1, 1)) == 4
    assert state.after((1, 5, 6)).in_reasoning is False and state.in_reasoning   # `after` copies
    assert state.after((1, 1, 1, 1)).forced_token() == 5


def test_the_sampler_writes_a_forced_token_and_leaves_other_rows_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=0.0, logprobs=1)
    rows = [SamplingRow(p, [1], 1, (), None), SamplingRow(p, [1], 1, (), None, forced_token_id=7),
            SamplingRow(p, [1], 1, (), None)]
    out = Sampler(torch.device("cpu"))(logits.clone(), rows)
    greedy = logits.argmax(-1).tolist()
    assert out.token_ids == [greedy[0], 7, greedy[2]]
    assert out.logprobs[1] is not None      # the model's log-probability of the forced token
