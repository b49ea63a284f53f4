"""vLLM's KV-event payload, encoded without msgspec (vllm/distributed/kv_events.py, main).

vLLM encodes with msgspec: the batch is `array_like` (a positional array), each event a
`tag=True` struct without `array_like` since vllm-project/vllm#42892 (a map whose first key is
"type"), all with `omit_defaults` (a field left at its default is not written; fields without a
default always are, None included):

    batch  [ts: float64, [event, ...], data_parallel_rank: int]
    event  {"type": "BlockStored", "block_hashes": [u64..], "parent_block_hash": u64 | nil,
            "token_ids": [..], "block_size": n, "lora_id": nil, "medium": "GPU",
            "lora_name": nil}
           {"type": "BlockRemoved", "block_hashes": [u64..], "medium": "GPU"}
           {"type": "AllBlocksCleared"}

msgpack here packs the same values in the same order with the same (smallest) widths, so the
bytes equal msgspec's; tests/test_kv_events.py checks that against vLLM's struct definitions.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

_U64 = (1 << 64) - 1


def external_hash(digest: bytes) -> int:
    """A block hash as routers see it: vLLM's `maybe_convert_block_hash` (its default,
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the digest big-endian, its low 64 bits, unsigned."""
    return int.from_bytes(digest, "big") & _U64


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str

    def wire(self) -> dict:
        return {
            "type": "BlockStored",
            "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": self.medium,
            "lora_name": None,
        }


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str

    def wire(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}


@dataclass(frozen=True)
class AllBlocksCleared:
    def wire(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int = 0) -> bytes:
    # vLLM's publisher fills in its rank before encoding, so the third element is always sent.
    return msgpack.packb([float(ts), [e.wire() for e in events], data_parallel_rank])
