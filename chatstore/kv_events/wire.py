"""vLLM's KV-event payload as msgspec Structs (vllm/distributed/kv_events.py, v0.26 and main).

The same field order, tags and struct options as vLLM, so msgspec writes the bytes vLLM writes.
Since vllm-project/vllm#42892 (vLLM 0.26) the batch stays `array_like` (a positional array) and
each event is a `tag=True` struct without `array_like`: a map whose first key is "type". With
`omit_defaults` a field left at its default is not written; fields without a default always
are, None included:

    batch  [ts: float64, [event, ...], data_parallel_rank: int]
    event  {"type": "BlockStored", "block_hashes": [u64..], "parent_block_hash": u64 | nil,
            "token_ids": [..], "block_size": n, "lora_id": nil, "medium": "GPU",
            "lora_name": nil}
           {"type": "BlockRemoved", "block_hashes": [u64..], "medium": "GPU"}
           {"type": "AllBlocksCleared"}

The trailing defaulted fields (extra_keys, group_idx, kv_cache_spec_*) are declared so a
decoder of ours reads vLLM's own batches; we leave them unset: one KV cache group, full
attention, which is what a consumer assumes when they are absent. Positional construction
follows the field order: `BlockStored(hashes, parent, tokens, block_size, None, medium, None)`.
"""

from __future__ import annotations

from typing import Any

import msgspec

_U64 = (1 << 64) - 1


def external_hash(digest: bytes) -> int:
    """A block hash as routers see it: vLLM's `maybe_convert_block_hash` (its default,
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the digest big-endian, its low 64 bits, unsigned."""
    return int.from_bytes(digest, "big") & _U64


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag is the class name, under the key "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # vLLM keeps it for old consumers; no LoRA here, so always None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int = 0) -> bytes:
    # vLLM's publisher fills in its rank before encoding, so the third element is always sent.
    return msgspec.msgpack.encode(KVEventBatch(float(ts), events, data_parallel_rank))
