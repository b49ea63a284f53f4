"""Codec: round trip in every storage dtype, checksum catches every flipped byte, chunking."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from chatstore.store.session_kv import SessionKV, common_prefix_len
from chatstore.store.tiers import codec


def _value(num_tokens: int = 5, dtype: torch.dtype = torch.float32, seed: int = 0) -> SessionKV:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((2, 2, num_tokens, 2, 4), generator=g).to(dtype)
    return SessionKV(list(range(100, 100 + num_tokens)), kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_keeps_tokens_dtype_shape_and_bits(dtype):
    value = _value(dtype=dtype)
    back = codec.decode(codec.encode(value, "fp-a"), "fp-a")
    assert back.dtype == dtype
    assert back.equal(value)


def test_half_precision_halves_the_payload():
    full = len(codec.encode(_value(64), "fp"))
    half = len(codec.encode(_value(64, torch.float16), "fp"))
    assert half < 0.55 * full


def test_every_flipped_byte_is_detected():
    blob = codec.encode(_value(3), "fp")
    for i in range(len(blob)):
        damaged = bytearray(blob)
        damaged[i] ^= 0x10
        with pytest.raises(codec.CorruptValueError):
            codec.decode(bytes(damaged), "fp")


def test_truncated_value_is_corrupt():
    blob = codec.encode(_value(3), "fp")
    for cut in (0, 5, 11, len(blob) - 1):
        with pytest.raises(codec.CorruptValueError):
            codec.decode(blob[:cut], "fp")


def test_other_model_fingerprint_is_refused():
    blob = codec.encode(_value(), "model-a")
    with pytest.raises(codec.FingerprintMismatch):
        codec.decode(blob, "model-b")


def test_empty_session_round_trips():
    value = SessionKV([], torch.zeros((2, 2, 0, 2, 4)))
    assert codec.decode(codec.encode(value, "fp"), "fp").num_tokens == 0


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5], [6]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 5, 100])
def test_encode_decode_round_trips(dtype, tokens):
    from chatstore.store.session_kv import SessionKV
    from chatstore.store.tiers.codec import decode, encode

    v = SessionKV(list(range(tokens)), torch.randn(2, 2, tokens, 3, 4).to(dtype))
    assert decode(encode(v, "fp"), "fp").equal(v)


def test_kv_starts_aligned_and_an_owned_buffer_is_viewed_not_copied():
    """Sealed values open into a buffer of their own (sealing/sealer.py open_owned): the KV
    starts at a multiple of KV_ALIGN, so decode_owned views it there (issue 33: one pass over
    the bytes on a sealed read, as on a clear one)."""
    for dtype in (torch.float32, torch.bfloat16):
        value = _value(5, dtype)
        blob = codec.encode(value, "fp")
        header_len = int.from_bytes(blob[8:12], "little")
        assert (12 + header_len + 4 * value.num_tokens) % codec.KV_ALIGN == 0
        buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        back = codec.decode_owned(buf, "fp")
        assert back.equal(value) and back.token_ids == value.token_ids
        assert back.kv.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_a_value_written_before_the_alignment_still_decodes_owned():
    value = _value(3)
    blob = codec.encode(value, "fp")
    header_len = int.from_bytes(blob[8:12], "little")
    header = bytes(blob[12 : 12 + header_len]).rstrip(b" ") + b" "  # one space: misaligned
    body = struct.pack("<I", len(header)) + header + bytes(blob[12 + header_len :])
    old = codec.MAGIC + struct.pack("<I", zlib.crc32(body)) + body
    assert (12 + len(header)) % 4  # the token ids are not even 4-aligned
    back = codec.decode_owned(torch.frombuffer(bytearray(old), dtype=torch.uint8), "fp")
    assert back.equal(value) and codec.decode(old, "fp").equal(value)


def test_sealable_parts_are_encode_bytes_with_a_zero_crc_that_only_an_authenticated_read_skips():
    """A sealed value's checksum is its AES-GCM tag (codec.py): its parts are encode()'s
    bytes with the crc32 field 0, the KV part is the tensor's own memory (no copy), and
    only a decode told the bytes were authenticated accepts them."""
    for dtype in (torch.float32, torch.bfloat16):
        value = _value(7, dtype)
        head, body = codec.sealable_parts(value, "fp")
        clear = codec.encode(value, "fp")
        joined = bytes(head) + bytes(body)
        assert joined[8:] == bytes(clear[8:]) and joined[4:8] == b"\0\0\0\0"
        assert body.nbytes == value.kv.numel() * value.kv.element_size()
        with pytest.raises(codec.CorruptValueError, match="checksum"):
            codec.decode(joined, "fp")
        assert codec.decode(joined, "fp", authenticated=True).equal(value)
        owned = codec.decode_owned(
            torch.frombuffer(bytearray(joined), dtype=torch.uint8), "fp", True
        )
        assert owned.equal(value) and owned.token_ids == value.token_ids
