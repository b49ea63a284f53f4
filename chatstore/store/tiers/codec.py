"""Serialise a SessionKV to bytes that say what they hold and prove they are intact.

    0      4        8            12                12+H
    | magic | crc32 | header len H | header (JSON) | token ids (int32 LE) | kv bytes |
                    '---------------- covered by crc32 ------------------------------'

A value stored sealed (sealing/sealer.py) is checked by its AES-GCM tag, which authenticates
every byte beneath it: its crc32 field is 0 and never computed or checked (`sealable_parts`,
`decode_owned(..., authenticated=True)`). The CRC's pass over the MBs of a chunk costs five
times the cipher's (zlib 2.8 ms against AES-GCM 0.5 ms for a 5.9 MB chunk on a Xeon), and
proves nothing the tag has not.

The header is padded with spaces (JSON ignores them) so that the kv bytes start at a multiple of
64: a reader that opens a sealed value into a buffer of its own (`decode_owned`) views the KV
there, with no copy; `decode` copies the payload out of a buffer it does not own.

The header carries the model fingerprint, dtype and shape: a value of another model or dtype is
refused (FingerprintMismatch), a value whose bytes changed is refused (CorruptValueError) — the
caller drops it and recomputes, so a wrong answer is never served from a bad entry. One value is
one KV chunk (Store v2), stored under one key in LMDB and in Redis.

An int8 value (kv_storage_dtype = int8) is the packed form of store/kv_quant.py: its kv bytes
are the int8 rows with each row's fp16 scale in its last two bytes, its shape [L, 2, T, Hkv,
D + 2]; the header adds "kv_format" naming that layout, and an int8 value without it, or with
another, is refused as corrupt (its bytes could not be read as KV).
"""

from __future__ import annotations

import json
import struct
import zlib

import numpy
import torch

from chatstore.store import kv_quant
from chatstore.store.session_kv import SessionKV

MAGIC = b"CSK1"
_PREFIX = struct.Struct("<4sII")  # magic, crc32, header length
KV_ALIGN = 64  # where the kv bytes start in a value (values written before: anywhere)

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}


class CorruptValueError(ValueError):
    """A stored value failed its checksum or cannot be parsed."""


class FingerprintMismatch(ValueError):
    """A stored value was written by another model, weights or dtype."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kv_and_head(value: SessionKV, fingerprint: str) -> tuple[torch.Tensor, bytes]:
    """The value's KV on the CPU, and the bytes before it: header length, header, token ids."""
    kv = value.kv.detach().to("cpu").contiguous()
    fields = {
        "fingerprint": fingerprint,
        "dtype": dtype_name(kv.dtype),
        "shape": list(kv.shape),
        "num_tokens": value.num_tokens,
    }
    if kv_quant.is_quantized(kv.dtype):
        fields["kv_format"] = kv_quant.FORMAT
    header = json.dumps(fields).encode()
    tokens = torch.tensor(value.token_ids, dtype=torch.int32).numpy().astype("<i4").tobytes()
    header += b" " * (-(_PREFIX.size + len(header) + len(tokens)) % KV_ALIGN)
    return kv, struct.pack("<I", len(header)) + header + tokens


def encode(value: SessionKV, fingerprint: str) -> bytearray:
    """The value's bytes, built in one buffer: the KV is copied once, then checksummed."""
    kv, head = _kv_and_head(value, fingerprint)
    body = kv.view(torch.uint8).reshape(-1).numpy()
    start = 8 + len(head)
    out = bytearray(start + body.nbytes)
    out[8:start] = head
    numpy.frombuffer(out, dtype=numpy.uint8, offset=start)[:] = body
    out[:8] = MAGIC + struct.pack("<I", zlib.crc32(memoryview(out)[8:]))
    return out


def sealable_parts(value: SessionKV, fingerprint: str) -> list[bytes | memoryview]:
    """The value's bytes as encode() lays them out, in two parts for Sealer.seal_parts (the
    KV is the tensor's own memory, not copied), with the crc32 field 0: the seal's tag is
    the checksum of a sealed value."""
    kv, head = _kv_and_head(value, fingerprint)
    return [MAGIC + struct.pack("<I", 0) + head, kv.view(torch.uint8).reshape(-1).numpy().data]


def decode(
    blob: bytes | bytearray | memoryview, fingerprint: str, authenticated: bool = False
) -> SessionKV:
    """The SessionKV in `blob`; CorruptValueError or FingerprintMismatch when it is not usable.
    authenticated: blob was opened under AES-GCM, whose tag stands for the crc32 (not
    checked: a sealed value carries none)."""
    header, start = _verified_header(blob, authenticated)
    payload = bytearray(memoryview(blob)[start:])
    return _session_kv(header, payload, fingerprint)


def decode_owned(buf: torch.Tensor, fingerprint: str, authenticated: bool = False) -> SessionKV:
    """decode() of a value in `buf` (uint8, 1-D), a buffer the caller hands over: the KV is a
    view of it where it starts aligned for its dtype (every value written since KV_ALIGN),
    else a copy."""
    header, start = _verified_header(buf.numpy().data, authenticated)
    payload = buf[start:]
    n = int(header.get("num_tokens", 0))
    width = _DTYPES.get(str(header.get("dtype")), torch.uint8).itemsize
    if start % 4 or (start + 4 * n) % width:  # written before the padding: a copy, aligned
        payload = payload.clone()
    return _session_kv(header, payload, fingerprint)


def _session_kv(header: dict, payload: torch.Tensor | bytearray, fingerprint: str) -> SessionKV:
    if header.get("fingerprint") != fingerprint:
        raise FingerprintMismatch(
            f"value written by model {header.get('fingerprint')!r}, this is {fingerprint!r}"
        )
    try:
        dtype = _DTYPES[header["dtype"]]
        if kv_quant.is_quantized(dtype) and header.get("kv_format") != kv_quant.FORMAT:
            raise ValueError(f"int8 KV in an unknown layout {header.get('kv_format')!r}")
        shape = [int(x) for x in header["shape"]]
        n = int(header["num_tokens"])
        raw = payload if isinstance(payload, torch.Tensor) else _bytes_tensor(payload)
        tokens = raw[: 4 * n].view(torch.int32) if n else None
        if len(raw) > 4 * n:
            kv = raw[4 * n :].view(dtype).reshape(shape)
        else:
            kv = torch.empty(shape, dtype=dtype)
    except (KeyError, ValueError, RuntimeError, TypeError) as exc:
        raise CorruptValueError(f"malformed KV value: {exc}") from exc
    ids = tokens.tolist() if tokens is not None else []
    try:
        return SessionKV(ids, kv)
    except ValueError as exc:
        raise CorruptValueError(str(exc)) from exc


def _bytes_tensor(payload: bytearray) -> torch.Tensor:
    if not payload:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(payload, dtype=torch.uint8)


def _verified_header(
    blob: bytes | bytearray | memoryview, authenticated: bool = False
) -> tuple[dict, int]:
    """The header of a value whose checksum holds (or that an AEAD tag authenticated), and
    where its token ids start."""
    data = memoryview(blob)
    if len(data) < _PREFIX.size:
        raise CorruptValueError("KV value too short")
    magic, crc, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptValueError(f"bad magic {bytes(magic)!r}")
    if not authenticated and zlib.crc32(data[8:]) != crc:
        raise CorruptValueError("KV value checksum mismatch")
    start = _PREFIX.size
    try:
        header = json.loads(bytes(data[start : start + header_len]))
    except ValueError as exc:
        raise CorruptValueError(f"bad KV header: {exc}") from exc
    return header, start + header_len
