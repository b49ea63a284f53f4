"""Turn a batch of next-token logits into token ids, one per running sample.

Order of operations (as in vLLM / the OpenAI API):

    logits [B, V] ─► + logit_bias ─► repetition penalty (prompt + output tokens)
                  ─► - presence·(count>0) - frequency·count (output tokens)
                  ─► temperature 0 ? argmax
                                   : / temperature ─► top_k ─► top_p ─► min_p ─► draw

A draw is inverse-CDF sampling: one uniform u per row, token = first index where the cumulative
probability exceeds u·total. Each seeded sample owns a CPU `torch.Generator` seeded from
(seed, sample_index) and draws its own u, so its output does not depend on the other rows of the
batch, on its row, nor on the device the logits live on.

Penalties are sparse: only the tokens a sample has seen (prompt ∪ output) are gathered, changed
and scattered back, so their cost grows with the history, not with batch × vocabulary.

Whole-vocabulary passes are what a step's sampling costs on CPU (a [32, 49152] fp32 batch is
6 MB per pass), so each row is also seen as blocks of BLOCK tokens with their maxima: the greedy
argmax and the top-k / top-p searches look inside the few best blocks only (`_Blocks`), and a
row whose filter keeps few tokens draws from those blocks. What remains over the whole row is
the temperature, the block maxima and, for top_p without top_k, the normaliser.
"""

from __future__ import annotations

import os

import torch

from chatstore.engine.request import SamplingParams

GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy (as vLLM does)
NUCLEUS_WIDTHS = (16, 64, 256, 1024)  # top_p alone is tried on this many best tokens, then on all
BLOCK = 64  # vocabulary block of the two-level searches (see _Blocks)
_MASK64 = (1 << 64) - 1
_shared_generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))


class SampleState:
    """Everything sampling needs to know about one running sample (one of a request's n)."""

    def __init__(
        self, params: SamplingParams, prompt_token_ids: list[int], sample_index: int = 0
    ) -> None:
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.sample_index = sample_index
        self.output_token_ids: list[int] = []
        self.output_counts: dict[int, int] = {}  # token id -> times generated
        self._prompt_ids: torch.Tensor | None = None  # unique prompt ids (CPU), built on demand
        self._prompt_set: set[int] | None = None
        self._generator: torch.Generator | None = None
        if params.repetition_penalty != 1.0:
            self._prompt_set = set(self.prompt_token_ids)
            self._prompt_ids = torch.tensor(sorted(self._prompt_set), dtype=torch.long)
        self._new_ids: list[int] = []  # output ids absent from the prompt, first-seen order

    def append(self, token_id: int) -> None:
        """Record a generated token (and the counts the penalties use)."""
        self.output_token_ids.append(token_id)
        count = self.output_counts.get(token_id, 0)
        self.output_counts[token_id] = count + 1
        if count == 0 and self._prompt_set is not None and token_id not in self._prompt_set:
            self._new_ids.append(token_id)

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0

    def seen_ids(self) -> torch.Tensor:
        """Unique ids of prompt ∪ output [S] (CPU): where the repetition penalty applies."""
        assert self._prompt_ids is not None, "only tracked when repetition_penalty != 1"
        if not self._new_ids:
            return self._prompt_ids
        return torch.cat([self._prompt_ids, torch.tensor(self._new_ids, dtype=torch.long)])

    def uniform(self) -> float:
        """The next u ~ U[0, 1) of this seeded sample's own generator."""
        if self._generator is None:
            seed = _mix_seed(self.params.seed or 0, self.sample_index)
            self._generator = torch.Generator().manual_seed(seed)
        return float(torch.rand((), generator=self._generator))


def sample_batch(logits: torch.Tensor, states: list[SampleState]) -> list[int]:
    """logits [B, V] (row i belongs to states[i]) -> one token id per row."""
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
    if not states:
        return []
    if any(s.params.logit_bias or s.needs_penalties for s in states):
        logits = logits.to(torch.float32, copy=True).contiguous()
        _apply_logit_bias(logits, states)
        _apply_penalties(logits, states)
    else:
        logits = logits.float()
    random_rows = [i for i, s in enumerate(states) if not s.greedy]
    if not random_rows:
        return _argmax(logits).tolist()
    if len(random_rows) == len(states):
        return _sample_random(logits, states).tolist()
    tokens = _argmax(logits)  # [B]
    rows = torch.tensor(random_rows, device=logits.device)
    tokens[rows] = _sample_random(logits[rows], [states[i] for i in random_rows])
    return tokens.tolist()


def _apply_logit_bias(logits: torch.Tensor, states: list[SampleState]) -> None:
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


def _apply_penalties(logits: torch.Tensor, states: list[SampleState]) -> None:
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


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), the same index (first of equal maxima; NaN counts as largest),
    in two cheap passes: each block's max (vectorised), then argmax over blocks and within the
    winning block. Torch's CPU argmax over a whole row is ~7x slower than its amax."""
    rows, vocab = logits.shape
    if vocab % BLOCK or vocab < 4 * BLOCK:
        return logits.argmax(dim=-1)
    blocks = logits.contiguous().view(rows, vocab // BLOCK, BLOCK)
    best = blocks.amax(dim=-1).argmax(dim=-1, keepdim=True)  # [R, 1]: first block holding the max
    index = best.unsqueeze(-1).expand(rows, 1, BLOCK)
    within = blocks.gather(1, index).squeeze(1).argmax(dim=-1)  # [R]
    return best.squeeze(1) * BLOCK + within


class _Blocks:
    """Rows [R, V] seen as V / BLOCK blocks of BLOCK tokens, with the max of every block.

    The w largest values of a row lie in its w blocks of largest maxima: a token x in any other
    block is beaten by w blocks each holding a value >= x, so x is at most the row's w-th value.
    A top-w search (and a draw from tokens above the w-th value) then looks at w * BLOCK
    candidates in vocabulary order instead of the whole row.
    """

    def __init__(self, logits: torch.Tensor) -> None:
        rows, vocab = logits.shape
        self.logits = logits  # contiguous
        self.vocab = vocab
        self.view: torch.Tensor | None = None
        if vocab % BLOCK == 0:
            self.view = logits.view(rows, vocab // BLOCK, BLOCK)
            self.maxima = self.view.amax(dim=-1)  # [R, V / BLOCK]
        # width -> (rows, candidates, block ids) of the last search: the draw reuses them
        self._searched: dict[int, tuple[list[int], torch.Tensor, torch.Tensor]] = {}

    def pays(self, width: int) -> bool:
        """Whether `width` candidate blocks are few enough to beat a search of the whole row."""
        return self.view is not None and 4 * width * BLOCK <= self.vocab

    def candidates(self, rows: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of the rows' `width` best blocks [r, width * BLOCK] in vocabulary order,
        those blocks' ids [r, width] ascending)."""
        assert self.view is not None
        searched = self._searched.get(width)
        if searched is not None and set(rows) <= set(searched[0]):
            found, values, ids = searched
            if found == rows:
                return values, ids
            at = torch.tensor([found.index(r) for r in rows], device=values.device)
            return values[at], ids[at]
        index = self._index(rows)
        ids = self.maxima[index].topk(width, dim=-1).indices.sort(dim=-1).values
        values = self.view[index.unsqueeze(1), ids].view(len(rows), width * BLOCK)
        self._searched[width] = (rows, values, ids)
        return values, ids

    def top_values(self, rows: list[int], width: int) -> torch.Tensor:
        """The `width` largest logits of each row [r, width], descending (= topk's values)."""
        if self.pays(width):
            return self.candidates(rows, width)[0].topk(width, dim=-1).values
        logits = self.rows(rows)
        if width < self.vocab:
            return logits.topk(width, dim=-1).values
        return logits.sort(dim=-1, descending=True).values  # faster than topk(V)

    def rows(self, rows: list[int]) -> torch.Tensor:
        """The logits of these rows [r, V] (no copy when they are all the rows, in order)."""
        if rows == list(range(len(self.logits))):
            return self.logits
        return self.logits[self._index(rows)]

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, device=self.logits.device)


def _sample_random(logits: torch.Tensor, states: list[SampleState]) -> torch.Tensor:
    """logits [R, V] of non-greedy samples -> token ids [R].

    A row whose top_k / top_p keeps few tokens draws from its candidate blocks (see `_Blocks`)
    rather than the whole vocabulary: the kept tokens and their order are the same, so is the
    inverse-CDF draw up to float rounding (the softmax's normaliser sums the same terms, less
    the masked zeros, in another order).
    """
    device, vocab = logits.device, logits.shape[1]
    temperatures = [s.params.temperature for s in states]
    if any(t != 1.0 for t in temperatures):
        logits = logits / _column(temperatures, device)
    logits = logits.contiguous()
    top_k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in states]
    top_p = [s.params.top_p for s in states]
    min_p = [s.params.min_p for s in states]
    uniforms = _uniforms(states, device)  # [R, 1], drawn in row order whatever the grouping
    if not (any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p)):
        return _draw(logits, min_p, uniforms)
    blocks = _Blocks(logits)
    threshold, widths, inside = _nucleus(blocks, top_k, top_p)
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
        threshold = _column(min_p, device) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    cdf = probs.cumsum(dim=-1)  # [R, C], unnormalised after min_p
    target = uniforms * cdf[:, -1:]  # [R, 1]
    tokens = torch.searchsorted(cdf, target, right=True).clamp_max_(width - 1)  # [R, 1]
    landed_on_zero = probs.gather(1, tokens) <= 0  # rounding at the very top of the cdf
    if bool(landed_on_zero.any()):
        tokens = torch.where(landed_on_zero, probs.argmax(dim=-1, keepdim=True), tokens)
    return tokens.squeeze(1)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) the tokens below each row's top_k / top_p threshold (ties are kept)."""
    logits = logits.contiguous()
    threshold, _, _ = _nucleus(_Blocks(logits), top_k, top_p)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _nucleus(
    blocks: _Blocks, top_k: list[int], top_p: list[float]
) -> tuple[torch.Tensor, list[int], list[bool]]:
    """(smallest logit kept [R, 1], candidates searched per row, whether every kept token is
    among them per row).

    Only the W best logits of each row are sorted: W = the largest top_k, or the first of
    NUCLEUS_WIDTHS for rows with top_p alone; rows whose nucleus does not fit in W candidates
    are redone with the next width, and finally over the whole vocabulary. Each search looks at
    one candidate more than that, so a tie at the threshold outside the candidates shows.
    """
    vocab, device = blocks.vocab, blocks.logits.device
    widths = [
        k if k < vocab else (NUCLEUS_WIDTHS[0] if p < 1 else 1)
        for k, p in zip(top_k, top_p, strict=True)
    ]
    lse = None  # the whole row's normaliser, for rows with top_p but no top_k
    if any(k >= vocab and p < 1.0 for k, p in zip(top_k, top_p, strict=True)):
        lse = blocks.logits.logsumexp(dim=-1, keepdim=True)
    width = min(vocab, max(widths) + 1)
    rows = list(range(len(top_k)))
    threshold, complete, inside = _thresholds(blocks, rows, top_k, top_p, width, lse)
    searched = [width] * len(rows)
    for next_width in (*NUCLEUS_WIDTHS[1:], vocab):
        if bool(complete.all()):
            break
        if min(vocab, next_width + 1) <= width:
            continue
        width = min(vocab, next_width + 1)
        redo = [i for i, ok in enumerate(complete.tolist()) if not ok]
        at = torch.tensor(redo, device=device)
        k, p = [top_k[i] for i in redo], [top_p[i] for i in redo]
        row_lse = None if lse is None else lse[at]
        found = _thresholds(blocks, redo, k, p, width, row_lse)
        threshold[at], complete[at], inside[at] = found
        for i in redo:
            searched[i] = width
    return threshold, searched, inside.tolist()


def _thresholds(
    blocks: _Blocks,
    rows: list[int],
    top_k: list[int],
    top_p: list[float],
    width: int,
    lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(smallest logit kept [R, 1], whether the W candidates settled it [R], whether every
    token at or above it is among the W candidates [R]).

    best [R, W]:  v0 >= v1 >= ... >= v(k-1) | >= ... v(W-1)
    top_k keeps v >= v(k-1); top_p keeps v_j while the mass of v0..v(j-1) is < p
    """
    device, vocab = blocks.logits.device, blocks.vocab
    best = blocks.top_values(rows, width)  # [R, W] descending
    last = best[:, -1:]
    k_on = torch.tensor([k < vocab for k in top_k], device=device).unsqueeze(1)  # [R, 1]
    k_index = torch.tensor([min(k, width) - 1 for k in top_k], device=device).unsqueeze(1)
    kth = torch.where(k_on, best.gather(1, k_index), float("-inf"))  # [R, 1]
    # By position, not value: top_p then weighs exactly the k best even when v(k) ties v(k-1).
    best = best.masked_fill(torch.arange(width, device=device) > k_index, float("-inf"))
    p = _column(top_p, device)
    if not any(q < 1.0 for q in top_p):
        threshold = kth
        complete = torch.ones(len(top_k), dtype=torch.bool, device=device)
    else:
        norm = best.logsumexp(dim=-1, keepdim=True)  # [R, 1]: exact when top_k restricts the row
        if lse is not None:
            norm = torch.where(k_on, norm, lse)
        probs = (best - norm).exp()  # [R, W]
        keep = (probs.cumsum(dim=-1) - probs) < p
        keep[:, 0] = True
        nucleus = best.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
        threshold = torch.where(p < 1.0, nucleus, kth)
        complete = (k_on | (p >= 1.0) | (probs.sum(dim=-1, keepdim=True) >= p)).squeeze(1)
    if width == vocab:  # every token was a candidate
        return threshold, complete, torch.ones_like(complete)
    return threshold, complete, (threshold > last).squeeze(1)


def _uniforms(states: list[SampleState], device: torch.device) -> torch.Tensor:
    """u ~ U[0, 1) [R, 1]: seeded rows from their own generator, the rest from a shared one."""
    unseeded = iter(torch.rand(len(states), generator=_shared_generator).tolist())
    values = [s.uniform() if s.params.seed is not None else next(unseeded) for s in states]
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1).to(device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _mix_seed(seed: int, sample_index: int) -> int:
    """A 64-bit generator seed from (request seed, sample index) via splitmix64."""
    z = (seed + (sample_index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
