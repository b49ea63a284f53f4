"""Seal and open stored values: AES-256-GCM under the value's tenant data key (keyring.py).

    0        1         2          2+n      14+n
    | version | id len n | dek id | nonce (12) | ciphertext + tag (16) |

The dek id names which of the tenant's data keys sealed it ("d1", "d2" during a data-key
rotation). Associated data = "<purpose>\\0<tenant>\\0<key>": the tenant and the chunk or record
key the value is stored under, so a value moved to another key or tenant fails to open, as does
any changed bit. A fresh random nonce per seal (96 bits; a data key seals far fewer than 2^32
values before it is rotated). Opening never returns unauthenticated bytes, and never a value
that was not sealed: it returns the plaintext or raises OpenError (a subclass of the codec's
CorruptValueError). Values of version 1 (sealed by keys derived from the master key, before
envelope keys) do not open: they read as misses, as any value under a key the server lacks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from chatstore.store.sealing.keyring import Keyring
from chatstore.store.tiers.codec import CorruptValueError

VERSION = 2
NONCE_BYTES = 12
TAG_BYTES = 16
INTERNAL_PREFIX = "\x00"  # records of a tenant's internal namespace ("\x00responses:<tenant>")


class OpenError(CorruptValueError):
    """A value could not be opened: not sealed, another key or tenant, shredded, or changed.
    Readers treat it as a miss (counted in open_failures) and leave the value where it is."""


class SealedHeader(NamedTuple):
    dek_id: str
    body_offset: int  # where the nonce starts


def owner_tenant(tenant: str) -> str:
    """The tenant whose key seals a record: an internal namespace of a tenant (its stored
    Responses, "\\x00responses:<tenant>") is sealed under that tenant's key, so shredding the
    tenant covers it."""
    if tenant.startswith(INTERNAL_PREFIX) and ":" in tenant:
        return tenant.split(":", 1)[1]
    return tenant


def associated_data(purpose: bytes, tenant: str, key: bytes) -> bytes:
    return purpose + b"\0" + tenant.encode() + b"\0" + key


def read_header(blob: bytes | bytearray | memoryview) -> SealedHeader:
    """The data key a sealed value names; OpenError when it is no sealed value of this version."""
    data = memoryview(blob)
    if len(data) < 2 or data[0] != VERSION:
        raise OpenError("not a sealed value (version byte)")
    n = data[1]
    start = 2 + n
    if n == 0 or len(data) < start + NONCE_BYTES + TAG_BYTES:
        raise OpenError("sealed value too short")
    try:
        dek_id = bytes(data[2:start]).decode()
    except UnicodeDecodeError:
        raise OpenError("sealed value: bad key id") from None
    return SealedHeader(dek_id, start)


def is_sealed(blob: bytes | bytearray | memoryview) -> bool:
    try:
        read_header(blob)
    except OpenError:
        return False
    return True


class Sealer:
    """Seals values under their tenant's sealing data key; opens values of any of its keys."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring

    @property
    def sealing_id(self) -> str:
        """The master key id that wraps new data keys."""
        return self.keyring.sealing_id

    def seal(
        self, purpose: bytes, tenant: str, key: bytes, plaintext: bytes | bytearray
    ) -> bytearray:
        """plaintext sealed for (purpose, tenant, key) under the tenant's sealing data key."""
        return self.seal_parts(purpose, tenant, key, [plaintext])

    def seal_parts(
        self,
        purpose: bytes,
        tenant: str,
        key: bytes,
        parts: Sequence[bytes | bytearray | memoryview],
    ) -> bytearray:
        """seal() of the concatenation of `parts`, without building that concatenation: a
        KV chunk's header and its KV tensor's memory are encrypted straight into the sealed
        value (one pass over the MBs, where joining them first is a second)."""
        data_key = self.keyring.sealing_key(owner_tenant(tenant))
        nonce = os.urandom(NONCE_BYTES)
        kid = data_key.dek_id.encode()
        head = bytes((VERSION, len(kid))) + kid + nonce
        views = [memoryview(part).cast("B") for part in parts]
        size = sum(len(view) for view in views)
        out = bytearray(len(head) + size + TAG_BYTES)
        out[: len(head)] = head
        encryptor = Cipher(algorithms.AES(data_key.key), modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(associated_data(purpose, tenant, key))
        at = len(head)
        whole = memoryview(out)
        for view in views:
            # GCM is a stream mode: update_into writes len(view) bytes; the tag's room after
            # the last part is the block of slack it asks the output to have.
            at += encryptor.update_into(view, whole[at:])
        encryptor.finalize()
        whole[at:] = encryptor.tag
        return out

    def open(self, purpose: bytes, tenant: str, key: bytes, blob: bytes | memoryview) -> bytes:
        """The plaintext; OpenError when blob is not a value sealed for (purpose, tenant, key)
        under a data key this server holds."""
        header, cipher, aad = self._opening(purpose, tenant, key, blob)
        data = memoryview(blob)
        nonce = bytes(data[header.body_offset : header.body_offset + NONCE_BYTES])
        try:
            return cipher.decrypt(nonce, data[header.body_offset + NONCE_BYTES :], aad)
        except InvalidTag:
            raise OpenError(
                "sealed value failed to open (another key, tenant or changed)"
            ) from None

    def open_into(
        self, purpose: bytes, tenant: str, key: bytes, blob: bytes | memoryview, out: memoryview
    ) -> int:
        """open() into `out` (a reused buffer at least as long as the plaintext); its length."""
        header, cipher, aad = self._opening(purpose, tenant, key, blob)
        data = memoryview(blob)
        nonce = bytes(data[header.body_offset : header.body_offset + NONCE_BYTES])
        body = data[header.body_offset + NONCE_BYTES :]
        size = len(body) - TAG_BYTES
        try:
            cipher.decrypt_into(nonce, body, aad, out[:size])
        except InvalidTag:
            raise OpenError(
                "sealed value failed to open (another key, tenant or changed)"
            ) from None
        return size

    def open_owned(
        self, purpose: bytes, tenant: str, key: bytes, blob: bytes | memoryview
    ) -> torch.Tensor:
        """open() into a new uint8 tensor the caller keeps (codec.decode_owned views the KV
        in it): one pass over the bytes, as the clear path's one copy, with no zero-fill (a
        bytearray's) and no second copy out of a scratch buffer."""
        header = read_header(blob)
        size = len(memoryview(blob)) - header.body_offset - NONCE_BYTES - TAG_BYTES
        out = torch.empty(max(size, 0), dtype=torch.uint8)
        self.open_into(purpose, tenant, key, blob, out.numpy().data)
        return out

    def _opening(
        self, purpose: bytes, tenant: str, key: bytes, blob: bytes | memoryview
    ) -> tuple[SealedHeader, AESGCM, bytes]:
        header = read_header(blob)
        data_key = self.keyring.opening_key(owner_tenant(tenant), header.dek_id)
        if data_key is None:
            raise OpenError(
                f"sealed under data key {header.dek_id!r} of tenant {owner_tenant(tenant)!r}, "
                f"which this server does not hold (shredded, retired or another master key)"
            )
        return header, data_key.cipher, associated_data(purpose, tenant, key)

    def needs_reseal(self, tenant: str, blob: bytes | memoryview) -> bool:
        """Whether blob is sealed under one of tenant's data keys other than its sealing one
        (a data-key rotation under way). A value not sealed at all is never re-sealed here:
        only `encrypt-existing` adopts values written in the clear."""
        try:
            header = read_header(blob)
        except OpenError:
            return False
        return header.dek_id != self.keyring.sealing_dek_id(owner_tenant(tenant))
