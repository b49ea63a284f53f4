"""Constrained rows in the sampler: a grammar's mask applies to its own row only, after bias
and penalties, and the sample's state advances with each token it is given."""

from __future__ import annotations

import torch

from chatstore.engine.request import SamplingParams
from chatstore.engine.sample_state import SampleState
from chatstore.engine.sampling import sample_batch

V = 8


class AllowedSequence:
    """A real TokenConstraint: the output must spell `tokens`, then only `end` may follow."""

    def __init__(self, tokens: list[int], end: int) -> None:
        self.tokens, self.end, self.at = tokens, end, 0
        self.accepted: list[int] = []

    def mask(self, logits: torch.Tensor) -> None:
        allowed = self.tokens[self.at] if self.at < len(self.tokens) else self.end
        keep = logits[0, allowed].item()
        logits.fill_(float("-inf"))
        logits[0, allowed] = keep

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)
        self.at += 1


def run(states: list[SampleState], logits: torch.Tensor, steps: int) -> list[list[int]]:
    for _ in range(steps):
        for s, t in zip(states, sample_batch(logits, states), strict=True):
            s.append(t)
    return [s.output_token_ids for s in states]


def test_constrained_rows_follow_their_grammar_and_free_rows_are_untouched():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    spelled = [5, 1, 6]
    free = [SampleState(SamplingParams(temperature=1.0, seed=i), [1]) for i in (0, 2)]
    alone = run(
        [SampleState(SamplingParams(temperature=1.0, seed=i), [1]) for i in (0, 2)],
        logits[[0, 2]],
        4,
    )
    constrained = SampleState(
        SamplingParams(temperature=1.0, seed=1, constraint=lambda: AllowedSequence(spelled, 7)),
        [1],
    )
    mixed = run([free[0], constrained, free[1]], logits, 4)
    assert mixed[1] == [5, 1, 6, 7]
    assert [mixed[0], mixed[2]] == alone  # the same draws as without a constrained neighbour
    assert constrained.constraint is not None and constrained.constraint.accepted == [5, 1, 6, 7]


def test_the_mask_wins_over_logit_bias_and_each_sample_gets_its_own_state():
    logits = torch.zeros(2, V)
    params = SamplingParams(
        temperature=0.0, logit_bias={3: 100.0}, constraint=lambda: AllowedSequence([2, 4], 0)
    )
    a, b = SampleState(params, [1], 0), SampleState(params, [1], 1)
    assert run([a, b], logits, 3) == [[2, 4, 0], [2, 4, 0]]
    assert a.constraint is not b.constraint
