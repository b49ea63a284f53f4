"""Sampling through the engine: n>1 with shared blocks, seeds, stop strings/tokens, bad params."""

from __future__ import annotations

import pytest

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import InvalidRequestError, Request, SamplingParams
from tests.support.engine import (
    assert_pool_clean,
    finish_of,
    greedy,
    prompt,
    run_all,
    tiny_runtime,
    tokens_of,
)

pytestmark = pytest.mark.usefixtures("single_thread")

LETTERS = "abcdefghijklmnopqrstuvwxyz"


class TwoCharTokenizer:
    """Token i is two letters; ids 0 and 1 (bos, eos) are special and decode to nothing."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        keep = [i for i in ids if not (skip_special_tokens and i in (0, 1))]
        return "".join(LETTERS[i % 26] + LETTERS[(i // 26) % 26] for i in keep)


def text_of(outputs, index: int = 0) -> str:
    return "".join(s.text for o in outputs for s in o.samples if s.index == index)


def sampled(n: int = 4, seed: int | None = 7, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True)


def test_n4_shares_prompt_blocks_then_copies_on_write() -> None:
    engine = LLMEngine(tiny_runtime(num_blocks=32), EngineConfig())
    pool = engine.runtime.pool
    engine.add_request(Request("n4", prompt(5, 10), sampled()))  # blocks: 4 + 4 + 2 tokens
    outs = engine.step()  # prefill, fork into 4 samples, first token of each
    group = engine._groups["n4"]
    tables = [s.block_table for s in group.seqs]
    assert len(tables) == 4 and all(t == tables[0] for t in tables)
    assert pool.num_used == 3
    assert [pool.ref_count(b) for b in tables[0]] == [4, 4, 4]
    outs += engine.step()  # each sample writes into the shared partial block: 3 copies, 1 in place
    assert pool.num_used == 6
    tables = [s.block_table for s in group.seqs]
    assert len({t[2] for t in tables}) == 4 and len({t[0] for t in tables}) == 1
    outs += run_all(engine)["n4"]
    samples = [tokens_of(outs, i) for i in range(4)]
    assert all(len(s) == 12 for s in samples)
    assert len({tuple(s) for s in samples}) > 1
    assert outs[-1].usage.completion_tokens == 48
    assert_pool_clean(engine)


@pytest.mark.parametrize("layout", ["paged", "vattention"])
def test_n4_samples_are_independent_of_sharing_and_preemption(layout: str) -> None:
    request = Request("n4", prompt(6, 10), sampled())
    engine = LLMEngine(tiny_runtime(num_blocks=64, layout=layout), EngineConfig())
    engine.add_request(request)
    shared = run_all(engine)["n4"]
    # A pool so small the samples keep preempting each other: recomputed KV is per sample.
    tight = LLMEngine(
        tiny_runtime(num_blocks=8, layout=layout), EngineConfig(max_tokens_per_step=8)
    )
    tight.add_request(Request("n4", list(request.prompt_token_ids), request.sampling))
    recomputed = run_all(tight)["n4"]
    assert tight.stats().preemptions > 0
    for i in range(4):
        assert tokens_of(shared, i) == tokens_of(recomputed, i)
    assert_pool_clean(tight)


def test_seed_reproduces_a_sample_even_inside_a_batch() -> None:
    ids = prompt(8, 9)
    alone = LLMEngine(tiny_runtime(), EngineConfig())
    alone.add_request(Request("x", ids, sampled(n=1, seed=123)))
    ref = tokens_of(run_all(alone)["x"])
    batch = LLMEngine(tiny_runtime(), EngineConfig())
    batch.add_request(Request("other", prompt(9, 17), sampled(n=2, seed=None)))
    batch.add_request(Request("x", ids, sampled(n=1, seed=123)))
    batch.add_request(Request("y", ids, sampled(n=1, seed=124)))
    outs = run_all(batch)
    assert tokens_of(outs["x"]) == ref
    assert tokens_of(outs["y"]) != ref


def test_stop_string_spanning_two_tokens_is_never_emitted() -> None:
    ids = prompt(10, 8)
    engine = LLMEngine(tiny_runtime(tokenizer=TwoCharTokenizer()), EngineConfig())
    engine.add_request(Request("free", ids, greedy(10)))
    outs = run_all(engine)["free"]
    full_text, full_tokens = text_of(outs), tokens_of(outs)
    assert len(full_text) == 20
    stop = full_text[7:9]  # last letter of token 3 + first letter of token 4
    cut = full_text.find(stop)
    engine.add_request(Request("stopped", ids, greedy(10, stop=(stop,))))
    outs = run_all(engine)["stopped"]
    assert text_of(outs) == full_text[:cut]
    assert stop not in text_of(outs)
    assert finish_of(outs) == "stop"
    assert tokens_of(outs) == full_tokens[: (cut + len(stop) + 1) // 2]
    assert_pool_clean(engine)


def test_logit_bias_stop_token_ids_and_eos() -> None:
    engine = LLMEngine(tiny_runtime(tokenizer=TwoCharTokenizer()), EngineConfig())
    engine.add_request(Request("bias", prompt(1, 5), greedy(4, logit_bias={7: 100.0})))
    engine.add_request(
        Request("stoptok", prompt(1, 5), greedy(4, logit_bias={7: 100.0}, stop_token_ids=(7,)))
    )
    eos = SamplingParams(max_tokens=4, temperature=0.0, logit_bias={1: 100.0})
    engine.add_request(Request("eos", prompt(1, 5), eos))
    engine.add_request(Request("ignore", prompt(1, 5), greedy(4, logit_bias={1: 100.0})))
    outs = run_all(engine)
    assert tokens_of(outs["bias"]) == [7, 7, 7, 7] and text_of(outs["bias"]) == "ha" * 4
    assert finish_of(outs["bias"]) == "length"
    assert tokens_of(outs["stoptok"]) == [7] and finish_of(outs["stoptok"]) == "stop"
    assert text_of(outs["stoptok"]) == ""
    assert tokens_of(outs["eos"]) == [1] and finish_of(outs["eos"]) == "stop"
    assert tokens_of(outs["ignore"]) == [1, 1, 1, 1] and finish_of(outs["ignore"]) == "length"
    assert_pool_clean(engine)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_tokens=-1), "max_tokens"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(logit_bias={999: 1.0}), "logit_bias"),
        (SamplingParams(temperature=-0.5), "temperature"),
        (SamplingParams(n=0), "n"),
    ],
)
def test_invalid_parameters_name_the_field(params: SamplingParams, field: str) -> None:
    engine = LLMEngine(tiny_runtime(), EngineConfig())
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(Request("bad", prompt(1, 5), params))
    assert err.value.field == field
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(Request("bad", [5, 300], SamplingParams()))
    assert err.value.field == "prompt"
    assert not engine.has_work()
