"""What one forward step computes: a flat list of new tokens from one or more sequences.

sequence   0: 5 new tokens on top of 3 cached  |  1: 1 new token on top of 9 cached
input_ids  t t t t t                            |  t
positions  3 4 5 6 7                            |  9
slots      table0[p // B] * B + p % B           |  table1[9 // B] * B + 9 % B
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from chatstore.kernels.paged_decode import DecodePlan, make_decode_plan
from chatstore.kernels.paged_prefill import PrefillPlan, make_prefill_plan


@dataclass(frozen=True)
class SequenceChunk:
    """New tokens of one sequence for this step, placed after `start_pos` tokens already pooled."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


class DeviceSeqLayout(NamedTuple):
    """The step's sequence layout already on the device (Triton's `AttentionMeta` fields): the
    static buffers of a decode graph give it, so attention builds nothing per step."""

    block_tables: torch.Tensor  # [S, W]
    query_start: torch.Tensor  # [S + 1]: first row of each sequence, then T
    seq_lens: torch.Tensor  # [S]: context lengths, new tokens included
    max_query_len: int  # what the launch shape depends on
    max_seq_len: int


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # [S, max_blocks], padded with 0
    block_table_lists: list[list[int]]
    logits_indices: torch.Tensor  # rows of the hidden state that get logits
    block_size: int
    decode_plan: DecodePlan | None = field(default=None)
    # Sequence layout for the paged-prefill kernel, made on first use (not needed for decode).
    _prefill_plan: PrefillPlan | None = field(default=None, repr=False)
    # Who each sequence is (chunk order), so a KV sink can attribute rows to requests.
    request_ids: list[str] | None = field(default=None)
    device_layout: DeviceSeqLayout | None = field(default=None)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def prefill_plan(self) -> PrefillPlan:
        if self._prefill_plan is None:
            self._prefill_plan = make_prefill_plan(
                self.block_tables, self.query_lens, self.context_lens
            )
        return self._prefill_plan

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @classmethod
    def build(
        cls,
        chunks: list[SequenceChunk],
        block_size: int,
        device: str | torch.device = "cpu",
        all_logits: bool = False,
    ) -> ForwardBatch:
        """All tensors a forward needs; `all_logits` asks logits for every token, else the last."""
        if not chunks:
            raise ValueError("a forward batch needs at least one sequence")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        for chunk in chunks:
            if not chunk.token_ids:
                raise ValueError("every sequence in a batch needs at least one new token")
            needed = (chunk.context_len + block_size - 1) // block_size
            if len(chunk.block_table) < needed:
                raise ValueError(
                    f"block table has {len(chunk.block_table)} blocks, "
                    f"{chunk.context_len} tokens need {needed}"
                )
            ids.extend(chunk.token_ids)
            for p in range(chunk.start_pos, chunk.context_len):
                positions.append(p)
                slots.append(chunk.block_table[p // block_size] * block_size + p % block_size)
            last.append(len(ids) - 1)
        width = max(len(c.block_table) for c in chunks)
        tables = [c.block_table + [0] * (width - len(c.block_table)) for c in chunks]
        query_lens = [len(c.token_ids) for c in chunks]
        context_lens = [c.context_len for c in chunks]
        device = torch.device(device)
        batch = cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=torch.tensor(tables, dtype=torch.long, device=device),
            block_table_lists=[list(c.block_table) for c in chunks],
            logits_indices=torch.arange(len(ids), device=device)
            if all_logits
            else torch.tensor(last, dtype=torch.long, device=device),
            block_size=block_size,
        )
        if batch.is_decode:
            batch.decode_plan = make_decode_plan(
                batch.block_table_lists, context_lens, block_size, device
            )
        return batch
