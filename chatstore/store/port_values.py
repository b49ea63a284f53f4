"""The values that cross the store's ports (ports.py): a session found in the store, a turn's
plan and the chunks it changes, where a session's KV is, one tier's numbers, the context budget,
a stored chunk's text and the events the store tells its listeners. Plain data, no store part
behind them: this module imports only session_kv (the keys and the KV container)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV


@dataclass(frozen=True)
class StoredSession:
    """What the store holds of a session: its leading tokens whose chunks are all stored.
    `prepare_load` only: `origins`, the tier each chunk was in when the turn opened (else
    empty), and `version`, the session's KV version read before it was found (the read
    buffer's claim of a staged copy compares it; else None)."""

    key: SessionKey
    token_ids: list[int]
    chunks: list[ChunkKey]
    chunk_tokens: int
    origins: Mapping[ChunkKey, str] = field(default_factory=dict)
    version: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def span(self, index: int) -> tuple[int, int]:
        return chunk_span(index, self.chunk_tokens, len(self.token_ids))

    def tokens_by_origin(self, start: int, end: int) -> dict[str, int]:
        """Tokens [start, end) counted by the tier their chunk was in when the turn opened."""
        return tokens_by_tier(self.chunks, self.chunk_tokens, start, end, self.origins.get)

    def read_span(self, read: ReadRows, start: int, end: int) -> HistoryRead:
        """The rows of positions [start, end) from the chunks that hold them, one `read` for
        all of them, up to the first chunk that is gone:

            chunks   [ c0 | c1 | c2 | c3 ]          C tokens each; [start, end) = [1.5 C, 3.2 C)
            read          c1[.5C:] c2 c3[:.2C]      parts: (value, first position)
        """
        C = self.chunk_tokens
        first, last = start // C, -(-end // C)
        spans = [(max(start - i * C, 0), min(end - i * C, C)) for i in range(first, last)]
        parts: list[tuple[SessionKV, int]] = []
        for i, value in enumerate(read(self.chunks[first:last], spans)):
            if value is None:
                return HistoryRead(parts, (first + i) * C)
            parts.append((value, (first + i) * C + spans[i][0]))
        return HistoryRead(parts, end)


# Reads the given rows [a, b) of each chunk (None: the chunk is gone).
ReadRows = Callable[[list[ChunkKey], list[tuple[int, int]]], Sequence[SessionKV | None]]


class HistoryRead(NamedTuple):
    """A stored history's rows read: (value, its first position) per chunk, in order, and the
    position they reach (the span's end unless a chunk was gone or out of reach)."""

    parts: list[tuple[SessionKV, int]]
    reached: int


@dataclass(frozen=True)
class ChunkDelta:
    """A new chunk given as the first `keep` rows of the stored chunk `base` + `rows`."""

    base: ChunkKey
    keep: int
    rows: SessionKV  # the rows after the kept ones (token ids and KV)


ChunkBuilder = Callable[[], Mapping[ChunkKey, SessionKV | ChunkDelta]]  # a turn's new chunks


@dataclass(frozen=True)
class TurnPlan:
    """A turn's chain (chunks/plan.py) and which of its chunks are new; `bases`: new chunk ->
    (the stored chunk it extends, rows it keeps of it)."""

    token_ids: list[int]
    chain: list[ChunkKey]
    new_chunks: tuple[ChunkKey, ...]
    chunk_tokens: int
    bases: dict[ChunkKey, tuple[ChunkKey, int]] = field(default_factory=dict)

    def span(self, index: int) -> tuple[int, int]:
        return chunk_span(index, self.chunk_tokens, len(self.token_ids))

    def new_spans(self) -> list[tuple[int, ChunkKey, int, int]]:
        """(chain index, key, start, end) of every new chunk."""
        new = set(self.new_chunks)
        return [(i, k, *self.span(i)) for i, k in enumerate(self.chain) if k in new]


# Given the store's plan of a turn (which chunks are new, which extend a stored one): the
# builder of its new chunks and the bytes it will hold (KVSource.save_turn, engine thread).
TurnPreparer = Callable[[TurnPlan], tuple[ChunkBuilder, int]]


class KVPlacement(NamedTuple):
    """Where a session's stored KV is: tokens per tier (each chunk at its fastest tier)."""

    tokens_by_tier: dict[str, int]
    bytes_per_token: int

    @property
    def tokens(self) -> int:
        return sum(self.tokens_by_tier.values())

    @property
    def bytes_by_tier(self) -> dict[str, int]:
        return {t: n * self.bytes_per_token for t, n in self.tokens_by_tier.items()}


DEVICE_TIER = "device"


@dataclass(frozen=True)
class TierStats:
    """One tier's line. The store's tiers count chunk reads; the device tier (the engine's
    block pool, composed by the API's admin service) counts full prompt blocks."""

    name: str  # device | dram | ssd | remote
    capacity_bytes: int
    used_bytes: int
    sessions: int
    hits: int
    misses: int
    bytes_up: int  # moved towards the device (loads, prefetches)
    bytes_down: int  # moved away from the device (saves, demotions)
    evictions: int
    prefetches: int
    # Writes into this tier it did not take, by reason: map_full / disk_full (its LMDB map or
    # disk is full: the chunk stays in DRAM and the write-back retries), error (it raised).
    write_failures_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def write_failures(self) -> int:
        return sum(self.write_failures_by_reason.values())

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None


def store_hits(tiers: Sequence[TierStats]) -> tuple[int, int]:
    """Hits and misses of the store's tiers, the overall hit rate's terms. The device tier's
    are left out: a prompt block missed on the device and then read from DRAM would count as
    one miss and one hit, and the device counts blocks where the store counts chunks."""
    store = [t for t in tiers if t.name != DEVICE_TIER]
    return sum(t.hits for t in store), sum(t.misses for t in store)


@dataclass(frozen=True)
class ContextBudget:
    """A turn's context window and how its prompt and reply share it: the one place the
    budget is computed (the API checks a prompt with it, the store's cut plans with it)."""

    window: int  # tokens: the model's context, or less when the store is set smaller

    @classmethod
    def of(cls, model_max: int, store_max: int | None = None) -> ContextBudget:
        return cls(model_max if store_max is None else min(model_max, store_max))

    def reply_room(self, max_tokens: int) -> int:
        """Tokens kept free for the reply when a prompt is cut: at most 1/8 of the window."""
        return min(max_tokens, self.window // 8)

    def fits(self, prompt_tokens: int, reserve: int = 0) -> bool:
        return prompt_tokens + reserve <= self.window


class ChunkText(NamedTuple):
    """A full stored chunk's token ids and the chunk before it in its chain (None: first)."""

    token_ids: list[int]
    parent: ChunkKey | None


# -- what the store tells its listeners (ChunkCatalog) -----------------------------------------

EventKind = Literal[
    "stored", "hit", "miss", "promoted", "demoted", "evicted", "dropped", "prefetched", "corrupt",
    "deleted",
]  # fmt: skip


@dataclass(frozen=True)
class StoreEvent:
    kind: EventKind
    key: ChunkKey  # the chunk it happened to
    tier: str | None = None  # where it happened (for moves: the destination)
    nbytes: int = 0
    time: float = field(default_factory=time.time)


Listener = Callable[[StoreEvent], None]


# -- chunk arithmetic the values use -------------------------------------------------------------


def chunk_span(index: int, chunk_tokens: int, num_tokens: int) -> tuple[int, int]:
    """Token positions [start, end) of chunk `index` in a history of num_tokens."""
    start = index * chunk_tokens
    return start, min(start + chunk_tokens, num_tokens)


def tokens_by_tier(
    chunks: list[ChunkKey],
    chunk_tokens: int,
    start: int,
    end: int,
    tier_of: Callable[[ChunkKey], str | None],
) -> dict[str, int]:
    """Tokens [start, end) of a chain of `chunk_tokens`-token chunks, counted by their chunk's
    tier; the counts sum to end - start when `chunks` covers them and every chunk there has a
    tier (a chunk whose tier is None, or past the end of `chunks`, is not counted)."""
    out: dict[str, int] = {}
    C = chunk_tokens
    for i in range(start // C, min(len(chunks), -(-end // C))):
        n = min(end, (i + 1) * C) - max(start, i * C)
        tier = tier_of(chunks[i]) if n > 0 else None
        if tier is not None:
            out[tier] = out.get(tier, 0) + n
    return out
