"""Log-probabilities of sampled tokens, for the samples that ask (OpenAI's `logprobs`).

What is reported is vLLM's default (`logprobs_mode = "raw_logprobs"`): the log-softmax of the
model's own logits for that step, before logit_bias, penalties, temperature and top-k/top-p/
min-p. That is the model's distribution, comparable across requests whatever their sampling
knobs, and what a transformers forward of the same tokens gives. The token itself is drawn from
the processed logits, so a biased or filtered draw may pick a token the report ranks low.

Only the rows that ask pay: one log-softmax over their [R, V] rows, a gather and, when an
alternative is asked, one top-k.
"""

from __future__ import annotations

import torch

from chatstore.engine.request import TokenLogprob
from chatstore.engine.sample_state import SampleState


def wants_logprobs(states: list[SampleState]) -> bool:
    return any(s.params.logprobs is not None for s in states)


def record_logprobs(logits: torch.Tensor, states: list[SampleState], tokens: list[int]) -> None:
    """logits [B, V] as the model gave them (row i is states[i]), tokens[i] sampled for row i:
    hand each asking state its token's logprob and top alternatives (`SampleState.note_logprob`)."""
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    device = logits.device
    picked = logits.index_select(0, torch.tensor(rows, device=device)).float()  # [R, V]
    logprobs = torch.log_softmax(picked, dim=-1)  # [R, V]
    chosen_ids = torch.tensor([tokens[i] for i in rows], device=device).unsqueeze(1)  # [R, 1]
    chosen = logprobs.gather(1, chosen_ids).squeeze(1).tolist()  # [R]
    k = max(states[i].params.logprobs or 0 for i in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if k > 0:
        values, ids = logprobs.topk(k, dim=-1)  # [R, k] each, best first
        top_values, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        want = states[i].params.logprobs or 0
        top = tuple(zip(top_ids[j][:want], top_values[j][:want], strict=True))
        states[i].note_logprob(TokenLogprob(tokens[i], chosen[j], top))
