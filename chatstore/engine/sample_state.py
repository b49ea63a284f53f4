"""One running sample's state for sampling: its parameters, the prompt and output token ids
the penalties look at (the seen ids kept sorted and unique, built once), for a seeded sample
its own CPU generator seeded from (seed, sample index), so its draws depend on nothing else in
the batch, when it asks for them, the logprobs of its tokens not yet reported, and, when its
output is constrained, its grammar's state."""

from __future__ import annotations

import torch

from chatstore.engine.request import SamplingParams, TokenConstraint, TokenLogprob

GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy (as vLLM does)
_MASK64 = (1 << 64) - 1


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
        # logprobs: the sampler notes the drawn token's entry, `append` keeps it (a batch that
        # failed and is sampled row by row notes again: the last note is the drawn token's)
        self._noted: TokenLogprob | None = None
        self._logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.constraint: TokenConstraint | None = None  # its grammar's state, when constrained
        if params.constraint is not None:
            self.constraint = params.constraint()

    def note_logprob(self, entry: TokenLogprob) -> None:
        self._noted = entry

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """The entries of the tokens appended since the last call (None: not asked for)."""
        if self._logprobs is None:
            return None
        taken, self._logprobs = self._logprobs, []
        return taken

    def append(self, token_id: int) -> None:
        """Record a generated token (and the counts the penalties use)."""
        if self._logprobs is not None and self._noted is not None:
            self._logprobs.append(self._noted)
            self._noted = None
        if self.constraint is not None:
            self.constraint.accept(token_id)
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
            seed = mix_seed(self.params.seed or 0, self.sample_index)
            self._generator = torch.Generator().manual_seed(seed)
        return float(torch.rand((), generator=self._generator))


def mix_seed(seed: int, sample_index: int) -> int:
    """A 64-bit generator seed from (request seed, sample index) via splitmix64."""
    z = (seed + (sample_index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
