"""Sampling: bias, penalties, greedy, top-k/top-p/min-p, seeds and batch independence (CPU)."""

from __future__ import annotations

import pytest
import torch

from chatstore.engine.penalties import apply_logit_bias, apply_penalties
from chatstore.engine.request import InvalidRequestError, SamplingParams
from chatstore.engine.sample_state import SampleState
from chatstore.engine.sampling import sample_batch
from chatstore.engine.vocab_blocks import block_argmax, filter_top_k_top_p

V = 8


def state(prompt: tuple[int, ...] = (), index: int = 0, **params) -> SampleState:
    return SampleState(SamplingParams(**params), list(prompt), sample_index=index)


def draws(logits: torch.Tensor, states: list[SampleState], steps: int) -> list[list[int]]:
    """`steps` rounds of sampling over the same logits, appending each draw to its state."""
    for _ in range(steps):
        for s, token in zip(states, sample_batch(logits, states), strict=True):
            s.append(token)
    return [s.output_token_ids for s in states]


def random_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax() -> None:
    logits = random_logits(5)
    states = [state(temperature=0.0) for _ in range(5)]
    assert sample_batch(logits, states) == logits.argmax(dim=-1).tolist()


def test_tiny_temperature_is_greedy() -> None:
    logits = random_logits(3, seed=1)
    states = [state(temperature=1e-7) for _ in range(3)]
    assert sample_batch(logits, states) == logits.argmax(dim=-1).tolist()


def test_empty_batch_and_shape_mismatch() -> None:
    assert sample_batch(torch.zeros(0, V), []) == []
    with pytest.raises(ValueError):
        sample_batch(torch.zeros(2, V), [state()])


def test_logit_bias_forces_a_token() -> None:
    logits = random_logits(2, seed=2)
    forced = int(logits[0].argmin())
    states = [state(temperature=0.0, logit_bias={forced: 100.0}), state(temperature=0.0)]
    assert sample_batch(logits, states) == [forced, int(logits[1].argmax())]
    sampled = [state(temperature=1.0, seed=s, logit_bias={forced: 100.0}) for s in range(4)]
    assert sample_batch(random_logits(4, seed=3), sampled) == [forced] * 4


def test_logit_bias_can_ban_a_token() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert sample_batch(logits, [state(temperature=0.0, logit_bias={0: -100.0})]) == [1]


def test_sampling_does_not_modify_the_callers_logits() -> None:
    logits = random_logits(2, seed=4)
    before = logits.clone()
    states = [state(temperature=0.7, logit_bias={1: 5.0}, repetition_penalty=1.3, prompt=(2,))] * 2
    sample_batch(logits, states)
    assert torch.equal(logits, before)


def penalised(logits: torch.Tensor, s: SampleState) -> torch.Tensor:
    """The row after logit bias and penalties: what greedy takes the argmax of."""
    out = logits.clone().unsqueeze(0)
    apply_logit_bias(out, [s])
    apply_penalties(out, [s])
    return out[0]


def test_repetition_penalty_matches_hand_computation() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0, -0.5, 0.0])
    s = state(prompt=(0, 1), repetition_penalty=2.0)
    s.append(2)
    s.append(3)
    s.append(3)
    expected = torch.tensor([1.0, -4.0, 0.5, -2.0, 0.5, 3.0, -0.5, 0.0])
    assert torch.equal(penalised(logits, s), expected)


def test_presence_and_frequency_penalties_match_openai_formula() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0, -0.5, 0.0])
    s = state(prompt=(0, 1, 5), presence_penalty=0.5, frequency_penalty=0.25)
    for token in (2, 3, 3, 7, 3):
        s.append(token)
    expected = logits.clone()
    for token, count in {2: 1, 3: 3, 7: 1}.items():  # prompt tokens are not penalised
        expected[token] -= 0.5 + 0.25 * count
    assert torch.allclose(penalised(logits, s), expected)


def test_all_penalties_and_bias_together() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0, -0.5, 0.0])
    s = state(
        prompt=(4,),
        repetition_penalty=1.5,
        presence_penalty=-0.5,
        frequency_penalty=1.0,
        logit_bias={4: 1.0, 5: -2.0},
    )
    s.append(5)
    s.append(5)
    expected = logits.clone()
    expected[4] = (0.5 + 1.0) / 1.5  # bias, then repetition (prompt)
    expected[5] = (3.0 - 2.0) / 1.5 - (-0.5 + 1.0 * 2)  # bias, repetition, presence+frequency
    assert torch.allclose(penalised(logits, s), expected)


def test_penalties_only_touch_their_own_rows_and_steer_greedy() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]] * 2)
    plain = state(temperature=0.0)
    damped = state(temperature=0.0, frequency_penalty=2.0)
    assert draws(logits, [plain, damped], steps=3) == [[0, 0, 0], [0, 1, 0]]


def test_penalty_bookkeeping_follows_appends() -> None:
    s = state(prompt=(4, 2, 4), repetition_penalty=1.2)
    assert s.seen_ids().tolist() == [2, 4]
    for token in (1, 1, 4, 6):
        s.append(token)
    assert s.output_counts == {1: 2, 4: 1, 6: 1}
    assert s.seen_ids().tolist() == [2, 4, 1, 6]


def reference_filter(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Straightforward top-k then top-p on one row [V] (full sort), ties kept, as a reference."""
    ordered = logits.sort(descending=True).values
    kept = ordered[:k] if k else ordered
    probs = torch.softmax(kept, dim=0)
    before = probs.cumsum(dim=0) - probs
    threshold = kept[before < p].min()
    return logits.masked_fill(logits < threshold, float("-inf"))


@pytest.mark.parametrize(("vocab", "scale"), [(8, 1.0), (50, 1.0), (3000, 0.3), (3000, 2.5)])
def test_top_k_top_p_filter_matches_a_full_sort(vocab: int, scale: float) -> None:
    """Nuclei narrower than 64, between 64 and 1024, and wider (the widening fallbacks)."""
    settings = [(0, 1.0), (3, 1.0), (0, 0.5), (0, 0.95), (5, 0.8), (vocab, 0.9), (1, 0.3)]
    logits = random_logits(len(settings), vocab, seed=vocab) * scale
    top_k = [k if 0 < k < vocab else vocab for k, _ in settings]
    filtered = filter_top_k_top_p(logits, top_k, [p for _, p in settings])
    for row, (k, p) in enumerate(settings):
        assert torch.equal(filtered[row], reference_filter(logits[row], k, p)), (k, p)


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(6, vocab=50, seed=5)
    states = [state(temperature=1.5, top_k=1) for _ in range(6)]
    assert sample_batch(logits, states) == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_is_greedy() -> None:
    logits = random_logits(6, vocab=50, seed=6)
    states = [state(temperature=2.0, top_p=1e-6, seed=i) for i in range(6)]
    assert sample_batch(logits, states) == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])
    (tokens,) = draws(logits, [state(temperature=5.0, top_k=3, seed=0)], steps=200)
    assert set(tokens) == {5, 6, 7}


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05]])
    (tokens,) = draws(probs.log(), [state(top_p=0.75, seed=1)], steps=300)
    assert set(tokens) == {0, 1}  # 0.5 + 0.3 reaches 0.75; 0.1 and below are cut


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])
    (tokens,) = draws(probs.log(), [state(min_p=0.3, seed=2)], steps=300)
    assert set(tokens) == {0, 1, 2}  # threshold 0.3 * 0.4 = 0.12


def test_rows_mix_greedy_and_sampled_with_different_filters() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    states = [state(temperature=0.0), state(top_k=1), state(top_p=1e-6, seed=7)]
    assert sample_batch(logits, states) == [3, 3, 3]


def test_same_seed_same_draws_regardless_of_row_and_neighbours() -> None:
    logits = random_logits(1, vocab=64, seed=8)[0]
    (alone,) = draws(logits.unsqueeze(0), [state(seed=42, temperature=1.3)], steps=30)
    neighbours = [state(temperature=0.9), state(seed=7), state(seed=42, temperature=1.3)]
    batch = torch.stack([random_logits(1, 64, 9)[0], random_logits(1, 64, 10)[0], logits])
    assert draws(batch, neighbours, steps=30)[2] == alone
    mixed = [state(temperature=0.0), state(seed=42, temperature=1.3)]
    assert draws(torch.stack([logits, logits]), mixed, steps=30)[1] == alone


def test_different_seeds_and_sample_indices_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform: 30 equal draws would be a 1e-90 coincidence
    (a,) = draws(logits, [state(seed=1)], steps=30)
    (b,) = draws(logits, [state(seed=2)], steps=30)
    (c,) = draws(logits, [state(seed=1, index=1)], steps=30)
    (again,) = draws(logits, [state(seed=1)], steps=30)
    assert a == again
    assert a != b
    assert a != c


def test_unseeded_rows_are_not_all_equal() -> None:
    logits = torch.zeros(4, 1000)
    tokens = draws(logits, [state() for _ in range(4)], steps=10)
    assert len({tuple(t) for t in tokens}) > 1


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().unsqueeze(0).repeat(50, 1)
    states = [state(seed=100 + i) for i in range(50)]
    counts = torch.bincount(torch.tensor(draws(logits, states, steps=80)).flatten(), minlength=3)
    freq = counts.float() / counts.sum()
    # 4000 seeded draws: the standard error is <= 0.008, so 0.04 is a 5-sigma bound.
    assert torch.allclose(freq, probs, atol=0.04), freq


def test_temperature_sharpens_and_flattens() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().unsqueeze(0).repeat(40, 1)

    def top_share(temperature: float) -> float:
        states = [state(seed=200 + i, temperature=temperature) for i in range(40)]
        tokens = torch.tensor(draws(logits, states, steps=50))
        return float((tokens == 0).float().mean())

    assert top_share(0.25) > 0.9  # 0.6^4 / (0.6^4 + 0.3^4 + 0.1^4) = 0.94
    assert 0.35 < top_share(4.0) < 0.5  # 0.6^.25 / sum = 0.42


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"logit_bias": {V: 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"stop_token_ids": (V,)}, "stop_token_ids"),
        ({"stop": ("",)}, "stop"),
        ({"n": 0}, "n"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_validation_names_the_field(params: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**params).validate(vocab_size=V)
    assert info.value.field == field


def test_valid_params_pass() -> None:
    params = SamplingParams(top_p=0.9, top_k=5, seed=-3, logit_bias={V - 1: -100}, stop=("x",))
    assert params.validate(vocab_size=V) is params


def test_bf16_and_non_contiguous_logits() -> None:
    logits = random_logits(V, vocab=4, seed=11).t()  # [4, V], non-contiguous
    states = [state(temperature=0.0, repetition_penalty=1.5, prompt=(1,)) for _ in range(4)]
    expected = [
        int(penalised(row.contiguous(), s).argmax()) for row, s in zip(logits, states, strict=True)
    ]
    assert sample_batch(logits, states) == expected
    half = logits.to(torch.bfloat16)
    assert sample_batch(half, [state(temperature=0.0)] * 4) == half.float().argmax(-1).tolist()


# -- the blocked searches (vocabularies of many BLOCKs, as real models have) --------------------

BIG_V = 32768


def full_vocab_draw(logits: torch.Tensor, s: SampleState, u: float) -> int:
    """One row drawn the straightforward way: filter the whole row, softmax, inverse CDF."""
    p = s.params
    row = logits / p.temperature
    k = p.top_k if 0 < p.top_k < row.numel() else 0
    if p.top_p < 1:
        row = reference_filter(row, k, p.top_p)
    elif k:
        row = row.masked_fill(row < row.topk(k).values[-1], float("-inf"))
    cdf = torch.softmax(row, dim=0).cumsum(dim=0)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True))


def test_argmax_matches_torch_on_ties_nan_and_odd_vocabularies() -> None:
    g = torch.Generator().manual_seed(12)
    for vocab in (BIG_V, 64 * 7, 1000, 5):
        logits = torch.randn(6, vocab, generator=g)
        logits[1] = (logits[1] * 2).round()  # many ties: the first one wins
        logits[2] = float("-inf")
        logits[3, vocab // 2] = float("nan")
        logits[4, [vocab - 1, 0]] = 50.0
        assert block_argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
        assert (
            block_argmax(logits[:, ::1].t().contiguous().t()).tolist() == logits.argmax(-1).tolist()
        )


@pytest.mark.parametrize(
    "settings",
    [
        [(0, 0.9), (50, 1.0), (5, 0.8), (0, 0.5), (0, 0.99), (1, 1.0), (0, 1.0), (20, 0.7)],
        [(200, 0.95), (0, 0.9), (3, 1.0)],  # too wide for candidate blocks: whole rows
    ],
)
def test_top_k_top_p_draws_match_a_full_vocabulary_draw(settings) -> None:
    """Rows drawn from their candidate blocks land on the token a whole-row draw picks."""
    logits = random_logits(len(settings), BIG_V, seed=13) * 3

    def states(step: int) -> list[SampleState]:
        return [state(temperature=0.7, top_k=k, top_p=p, seed=100 * step + i)
                for i, (k, p) in enumerate(settings)]  # fmt: skip

    for step in range(10):
        twins = states(step)
        rows = zip(logits, twins, strict=True)
        expected = [full_vocab_draw(row, s, s.uniform()) for row, s in rows]
        assert sample_batch(logits, states(step)) == expected


def test_ties_at_the_threshold_in_other_blocks_are_kept() -> None:
    """top_k = 2 with the 2nd value shared by tokens far apart: every tie stays drawable."""
    logits = torch.full((1, BIG_V), -10.0)
    logits[0, 9] = 2.0
    tied = [5, 700, 1500, 3000, BIG_V - 1]
    logits[0, tied] = 1.0
    seen = set()
    for seed in range(300):
        seen.update(sample_batch(logits, [state(top_k=2, seed=seed)]))
    assert seen == {9, *tied}


def test_same_seed_same_draws_whatever_the_neighbours_filters() -> None:
    """A neighbour's top_k changes how wide the batch's candidate search is, not the draw."""
    logits = random_logits(1, BIG_V, seed=14)[0] * 2
    (alone,) = draws(logits.unsqueeze(0), [state(seed=5, top_p=0.9, temperature=0.8)], steps=40)
    batch = torch.stack([random_logits(1, BIG_V, 15)[0], logits, logits])
    neighbours = [state(top_k=300, seed=1), state(seed=5, top_p=0.9, temperature=0.8),
                  state(temperature=0.0)]  # fmt: skip
    assert draws(batch, neighbours, steps=40)[1] == alone
