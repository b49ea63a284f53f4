"""The logit processors before a draw, in place on fp32 logits [B, V]: each sample's
logit_bias, then the repetition penalty (prompt + output tokens: positive logits divided,
negative ones multiplied) and the presence / frequency penalties (output tokens).

Sparse: only the tokens a sample has seen are gathered, changed and scattered back, so the cost
grows with the history, not with batch x vocabulary."""

from __future__ import annotations

import torch

from chatstore.engine.sample_state import SampleState


def apply_logit_bias(logits: torch.Tensor, states: list[SampleState]) -> None:
    rows, cols, values = [], [], []
    for i, state in enumerate(states):
        for token, bias in state.params.logit_bias.items():
            rows.append(i)
            cols.append(token)
            values.append(float(bias))
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(values, device=device), accumulate=True)


def apply_penalties(logits: torch.Tensor, states: list[SampleState]) -> None:
    """In place (logits contiguous [B, V]): repetition, then presence / frequency penalties."""
    vocab, flat = logits.shape[1], logits.view(-1)
    rep_rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if rep_rows:
        ids = [states[i].seen_ids() for i in rep_rows]
        penalty = _per_element([states[i].params.repetition_penalty for i in rep_rows], ids)
        index = _flat_index(rep_rows, ids, vocab).to(logits.device)
        values = flat[index]
        penalty = penalty.to(logits.device)
        flat[index] = torch.where(values > 0, values / penalty, values * penalty)
    rows = [
        i for i, s in enumerate(states) if s.params.presence_penalty or s.params.frequency_penalty
    ]
    rows = [i for i in rows if states[i].output_counts]
    if rows:
        ids = [torch.tensor(list(states[i].output_counts), dtype=torch.long) for i in rows]
        counts = torch.cat(
            [
                torch.tensor(list(states[i].output_counts.values()), dtype=torch.float32)
                for i in rows
            ]
        )
        presence = _per_element([states[i].params.presence_penalty for i in rows], ids)
        frequency = _per_element([states[i].params.frequency_penalty for i in rows], ids)
        index = _flat_index(rows, ids, vocab).to(logits.device)
        flat[index] -= (presence + frequency * counts).to(logits.device)


def _flat_index(rows: list[int], ids: list[torch.Tensor], vocab: int) -> torch.Tensor:
    return torch.cat([row * vocab + row_ids for row, row_ids in zip(rows, ids, strict=True)])


def _per_element(values: list[float], ids: list[torch.Tensor]) -> torch.Tensor:
    """One value per row, repeated for each of that row's ids (CPU, fp32)."""
    lengths = torch.tensor([len(row_ids) for row_ids in ids])
    return torch.tensor(values, dtype=torch.float32).repeat_interleave(lengths)
