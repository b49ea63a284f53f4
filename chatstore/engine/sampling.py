"""Turn a batch of next-token logits into token ids, one per running sample.

Order of operations (as in vLLM / the OpenAI API):

    logits [B, V] ─► + logit_bias ─► repetition penalty (prompt + output tokens)     penalties.py
                  ─► - presence·(count>0) - frequency·count (output tokens)
                  ─► grammar mask (constrained rows: -inf where the grammar forbids)
                  ─► temperature 0 ? argmax                                       vocab_blocks.py
                                   : / temperature ─► top_k ─► top_p ─► min_p ─► draw

A draw is inverse-CDF sampling: one uniform u per row, token = first index where the cumulative
probability exceeds u·total. Each seeded sample owns a CPU `torch.Generator` seeded from
(seed, sample_index) and draws its own u (sample_state.py), so its output does not depend on the
other rows of the batch, on its row, nor on the device the logits live on.

Whole-vocabulary passes are what a step's sampling costs on CPU, so the greedy argmax and the
top-k / top-p searches look inside a row's few best vocabulary blocks only (vocab_blocks.py),
and a row whose filter keeps few tokens draws from those blocks. What remains over the whole
row is the temperature, the block maxima and, for top_p without top_k, the normaliser.

Samples that ask for logprobs get them from the logits as they came in (logprobs.py); a
constrained sample's row is masked to what its grammar allows next (after bias and penalties);
the rest pay one check per step.
"""

from __future__ import annotations

import os

import torch

from chatstore.engine.logprobs import record_logprobs, wants_logprobs
from chatstore.engine.penalties import apply_logit_bias, apply_penalties
from chatstore.engine.sample_state import SampleState
from chatstore.engine.vocab_blocks import BLOCK, VocabBlocks, block_argmax, column, nucleus

_shared_generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))

__all__ = ["SampleState", "sample_batch"]


def sample_batch(logits: torch.Tensor, states: list[SampleState]) -> list[int]:
    """logits [B, V] (row i belongs to states[i]) -> one token id per row."""
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
    if not states:
        return []
    tokens = _sample(logits, states)
    if wants_logprobs(states):
        record_logprobs(logits, states, tokens)  # the model's logits: untouched by _sample
    return tokens


def _sample(logits: torch.Tensor, states: list[SampleState]) -> list[int]:
    if any(s.params.logit_bias or s.needs_penalties or s.constraint for s in states):
        logits = logits.to(torch.float32, copy=True).contiguous()
        apply_logit_bias(logits, states)
        apply_penalties(logits, states)
        apply_constraints(logits, states)
    else:
        logits = logits.float()
    random_rows = [i for i, s in enumerate(states) if not s.greedy]
    if not random_rows:
        return block_argmax(logits).tolist()
    if len(random_rows) == len(states):
        return _sample_random(logits, states).tolist()
    tokens = block_argmax(logits)  # [B]
    rows = torch.tensor(random_rows, device=logits.device)
    tokens[rows] = _sample_random(logits[rows], [states[i] for i in random_rows])
    return tokens.tolist()


def apply_constraints(logits: torch.Tensor, states: list[SampleState]) -> None:
    """Forbid, in place in logits [B, V], what each constrained row's grammar does not allow
    next; last, so no bias or penalty brings a forbidden token back. Free rows are untouched:
    constrained and free samples share the batch."""
    for row, s in enumerate(states):
        if s.constraint is not None:
            s.constraint.mask(logits[row : row + 1])


def _sample_random(logits: torch.Tensor, states: list[SampleState]) -> torch.Tensor:
    """logits [R, V] of non-greedy samples -> token ids [R].

    A row whose top_k / top_p keeps few tokens draws from its candidate blocks (see `VocabBlocks`)
    rather than the whole vocabulary: the kept tokens and their order are the same, so is the
    inverse-CDF draw up to float rounding (the softmax's normaliser sums the same terms, less
    the masked zeros, in another order).
    """
    device, vocab = logits.device, logits.shape[1]
    temperatures = [s.params.temperature for s in states]
    if any(t != 1.0 for t in temperatures):
        logits = logits / column(temperatures, device)
    logits = logits.contiguous()
    top_k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in states]
    top_p = [s.params.top_p for s in states]
    min_p = [s.params.min_p for s in states]
    uniforms = _uniforms(states, device)  # [R, 1], drawn in row order whatever the grouping
    if not (any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p)):
        return _draw(logits, min_p, uniforms)
    blocks = VocabBlocks(logits)
    threshold, widths, inside = nucleus(blocks, top_k, top_p)
    groups: dict[int, list[int]] = {}  # candidate width (0: the whole row) -> rows
    for i, (width, ok) in enumerate(zip(widths, inside, strict=True)):
        groups.setdefault(width if ok and blocks.pays(width) else 0, []).append(i)
    tokens = []
    for width, group in groups.items():
        if width:
            candidates, ids = blocks.candidates(group, width)
        else:
            candidates = blocks.rows(group)
        at = None if len(group) == len(states) else torch.tensor(group, device=device)
        row_threshold = threshold if at is None else threshold[at]
        candidates = candidates.masked_fill(candidates < row_threshold, float("-inf"))
        row_uniforms = uniforms if at is None else uniforms[at]
        picked = _draw(candidates, [min_p[i] for i in group], row_uniforms)
        if width:
            block = ids.gather(1, (picked // BLOCK).unsqueeze(1)).squeeze(1)
            picked = block * BLOCK + picked % BLOCK
        tokens.append((group, picked))
    if len(tokens) == 1:
        return tokens[0][1]
    out = torch.empty(len(states), dtype=torch.long, device=device)
    for group, picked in tokens:
        out[torch.tensor(group, device=device)] = picked
    return out


def _draw(logits: torch.Tensor, min_p: list[float], uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, in column order, from rows of (masked) logits [R, C] -> columns [R]."""
    device, width = logits.device, logits.shape[1]
    probs = torch.softmax(logits, dim=-1)  # [R, C]
    if any(m > 0 for m in min_p):
        threshold = column(min_p, device) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    cdf = probs.cumsum(dim=-1)  # [R, C], unnormalised after min_p
    target = uniforms * cdf[:, -1:]  # [R, 1]
    tokens = torch.searchsorted(cdf, target, right=True).clamp_max_(width - 1)  # [R, 1]
    landed_on_zero = probs.gather(1, tokens) <= 0  # rounding at the very top of the cdf
    if bool(landed_on_zero.any()):
        tokens = torch.where(landed_on_zero, probs.argmax(dim=-1, keepdim=True), tokens)
    return tokens.squeeze(1)


def _uniforms(states: list[SampleState], device: torch.device) -> torch.Tensor:
    """u ~ U[0, 1) [R, 1]: seeded rows from their own generator, the rest from a shared one."""
    unseeded = iter(torch.rand(len(states), generator=_shared_generator).tolist())
    values = [s.uniform() if s.params.seed is not None else next(unseeded) for s in states]
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1).to(device)
