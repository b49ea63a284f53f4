"""The two-level searches over a row of logits: the vocabulary seen as blocks of BLOCK tokens
with their maxima, so the greedy argmax and the top-k / top-p thresholds look inside the few
best blocks only instead of the whole row (a [32, 49152] fp32 batch is 6 MB per pass on CPU).

    block_argmax        argmax: block maxima, then inside the winning block
    VocabBlocks         a row's w best values lie in its w blocks of largest maxima
    nucleus             each row's smallest kept logit under top_k / top_p, searched on W
                        candidates (NUCLEUS_WIDTHS), then wider, then the whole row
"""

from __future__ import annotations

import torch

NUCLEUS_WIDTHS = (16, 64, 256, 1024)  # top_p alone is tried on this many best tokens, then on all
BLOCK = 64  # vocabulary block of the two-level searches (see VocabBlocks)


def block_argmax(logits: torch.Tensor) -> torch.Tensor:
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


class VocabBlocks:
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


def filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) the tokens below each row's top_k / top_p threshold (ties are kept)."""
    logits = logits.contiguous()
    threshold, _, _ = nucleus(VocabBlocks(logits), top_k, top_p)
    return logits.masked_fill(logits < threshold, float("-inf"))


def nucleus(
    blocks: VocabBlocks, top_k: list[int], top_p: list[float]
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
    blocks: VocabBlocks,
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
    p = column(top_p, device)
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


def column(values: list[float], device: torch.device) -> torch.Tensor:
    """One value per row, as a column [R, 1] (fp32)."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
