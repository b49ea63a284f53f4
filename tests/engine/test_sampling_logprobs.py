"""Logprobs of sampled tokens: the log-softmax of the model's logits (vLLM's raw_logprobs),
only for the samples that ask; against transformers on the embedded model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from chatstore.config import Config
from chatstore.engine.async_engine import AsyncEngine, merge_outputs
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.request import (
    InvalidRequestError,
    Request,
    RequestOutput,
    SampleDelta,
    SamplingParams,
    TokenLogprob,
)
from chatstore.engine.runtime import create_runtime
from chatstore.engine.sample_state import SampleState
from chatstore.engine.sampling import sample_batch
from tests.support.reference import default_hf_model
from tests.support.tiny_models import chat_ids

V = 8


def state(**params) -> SampleState:
    return SampleState(SamplingParams(**params), [1, 2, 3])


def step(logits: torch.Tensor, states: list[SampleState]) -> list[int]:
    tokens = sample_batch(logits, states)
    for s, t in zip(states, tokens, strict=True):
        s.append(t)
    return tokens


def test_greedy_logprob_and_top_alternatives_are_the_log_softmax() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    states = [state(temperature=0.0, logprobs=k) for k in (0, 2, 5)]
    tokens = step(logits, states)
    expected = torch.log_softmax(logits, dim=-1)
    for row, (s, token) in enumerate(zip(states, tokens, strict=True)):
        (entry,) = s.take_logprobs() or []
        assert entry.token_id == token == int(expected[row].argmax())
        assert entry.logprob == pytest.approx(float(expected[row, token]), abs=1e-6)
        k = s.params.logprobs or 0
        values, ids = expected[row].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-6)
        assert s.take_logprobs() == []  # taken once


def test_samples_that_do_not_ask_get_nothing_and_the_same_tokens() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    plain = [state(temperature=1.0, seed=i) for i in range(4)]
    mixed = [state(temperature=1.0, seed=i, logprobs=1 if i % 2 else None) for i in range(4)]
    assert step(logits, plain) == step(logits, mixed)
    assert [s.take_logprobs() is None for s in mixed] == [True, False, True, False]
    assert all(s.take_logprobs() is None for s in plain)


def test_report_is_before_bias_penalties_and_temperature() -> None:
    """The raw distribution, as vLLM reports by default: a logit_bias that forces a token, a
    penalty and a temperature change what is drawn, never the reported logprobs."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    worst = int(logits[0].argmin())
    s = state(temperature=0.5, logit_bias={worst: 100.0}, presence_penalty=1.0, logprobs=3)
    (token,) = step(logits, [s])
    (entry,) = s.take_logprobs() or []
    raw = torch.log_softmax(logits[0], dim=-1)
    assert token == worst
    assert entry.logprob == pytest.approx(float(raw[worst]), abs=1e-6)
    assert [t for t, _ in entry.top] == raw.topk(3).indices.tolist()


def test_a_batch_resampled_row_by_row_keeps_the_drawn_tokens_entry() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    states = [state(temperature=0.0, logprobs=0) for _ in range(2)]
    sample_batch(logits, states)  # as if the batch failed after sampling: noted, not appended
    tokens = [sample_batch(logits[i : i + 1], [s])[0] for i, s in enumerate(states)]
    for s, t in zip(states, tokens, strict=True):
        s.append(t)
        assert [e.token_id for e in s.take_logprobs() or []] == [t]


def test_top_logprobs_out_of_range_names_the_field() -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(logprobs=21).validate(V)
    assert err.value.field == "top_logprobs"
    SamplingParams(logprobs=20).validate(V)


def test_merged_outputs_join_logprobs() -> None:
    a, b = TokenLogprob(1, -0.5), TokenLogprob(2, -1.5)
    first = RequestOutput("r", [SampleDelta(0, [1], "x", None, [a])])
    then = RequestOutput("r", [SampleDelta(0, [2], "y", "stop", [b])], finished=True)
    (merged,) = merge_outputs(first, then).samples
    assert merged.token_ids == [1, 2] and merged.logprobs == [a, b]


@pytest.mark.model
def test_greedy_logprobs_equal_transformers_log_softmax(default_model) -> None:
    """Each greedy token's logprob and top-5 equal log_softmax of a transformers forward of the
    prompt + the tokens generated before it (fp32)."""
    tok = default_model.tokenizer
    ids = chat_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=5)
    runtime = create_runtime(Config(kv_cache_bytes=64 << 20, dtype="float32"), model=default_model)

    async def main() -> list[RequestOutput]:
        engine = AsyncEngine(runtime, EngineConfig())
        engine.start()
        try:
            return [o async for o in engine.submit(Request("lp", ids, params))]
        finally:
            await engine.shutdown()

    outs = asyncio.run(main())
    generated = [t for o in outs for d in o.samples for t in d.token_ids]
    entries = [e for o in outs for d in o.samples for e in d.logprobs or []]
    assert [e.token_id for e in entries] == generated and len(generated) >= 2
    with torch.inference_mode():
        logits = default_hf_model()(torch.tensor([ids + generated])).logits[0].float()
    ref = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)  # [G, V]: row g predicts token g
    for g, entry in enumerate(entries):
        assert entry.token_id == int(ref[g].argmax())
        assert entry.logprob == pytest.approx(float(ref[g, entry.token_id]), abs=2e-4)
        values, top = ref[g].topk(5)
        assert [t for t, _ in entry.top] == top.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=2e-4)
