"""Seal and open stored values: AES-256-GCM under the value's tenant key.

    0        1         2          2+n      14+n
    | version | id len n | key id | nonce (12) | ciphertext + tag (16) |

Associated data = "<purpose>\\0<tenant>\\0<key>": the tenant and the chunk or record key the value
is stored under, so a value moved to another key or tenant fails to open, as does any changed
bit. A fresh random nonce per seal (96 bits; a key seals far fewer than 2^32 values between
rotations). Opening never returns unauthenticated bytes: it returns the plaintext or raises
OpenError (a subclass of the codec's CorruptValueError, so every reader already treats it as a
corrupt value: dropped, a miss, never served).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from cryptography.exceptions import InvalidTag

from chatstore.store.sealing.keyring import Keyring
from chatstore.store.tiers.codec import CorruptValueError

VERSION = 1
NONCE_BYTES = 12
TAG_BYTES = 16
INTERNAL_PREFIX = "\x00"  # records of a tenant's internal namespace ("\x00responses:<tenant>")


class OpenError(CorruptValueError):
    """A sealed value could not be opened: not sealed, another key or tenant, or changed."""


class SealedHeader(NamedTuple):
    key_id: str
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
    """The key id a sealed value names; OpenError when it is no sealed value of this version."""
    data = memoryview(blob)
    if len(data) < 2 or data[0] != VERSION:
        raise OpenError("not a sealed value (version byte)")
    n = data[1]
    start = 2 + n
    if n == 0 or len(data) < start + NONCE_BYTES + TAG_BYTES:
        raise OpenError("sealed value too short")
    try:
        key_id = bytes(data[2:start]).decode()
    except UnicodeDecodeError:
        raise OpenError("sealed value: bad key id") from None
    return SealedHeader(key_id, start)


class Sealer:
    """Seals values under the keyring's sealing secret; opens values of any secret it holds."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring

    @property
    def sealing_id(self) -> str:
        return self.keyring.sealing_id

    def seal(
        self, purpose: bytes, tenant: str, key: bytes, plaintext: bytes | bytearray
    ) -> bytearray:
        key_id = self.keyring.sealing_id
        cipher = self.keyring.cipher(key_id, owner_tenant(tenant))
        assert cipher is not None  # the sealing secret is always in the keyring
        nonce = os.urandom(NONCE_BYTES)
        kid = key_id.encode()
        head = bytes((VERSION, len(kid))) + kid + nonce
        # Encrypted straight into the value's buffer: a chunk (MBs) is not copied again.
        out = bytearray(len(head) + len(plaintext) + TAG_BYTES)
        out[: len(head)] = head
        aad = associated_data(purpose, tenant, key)
        cipher.encrypt_into(nonce, plaintext, aad, memoryview(out)[len(head) :])
        return out

    def open(self, purpose: bytes, tenant: str, key: bytes, blob: bytes | memoryview) -> bytes:
        """The plaintext; OpenError when blob is not a value sealed for (purpose, tenant, key)
        under a secret this keyring holds and the tenant's current key."""
        header = read_header(blob)
        cipher = self.keyring.cipher(header.key_id, owner_tenant(tenant))
        if cipher is None:
            raise OpenError(f"sealed under key id {header.key_id!r}, which this server lacks")
        data = memoryview(blob)
        nonce = data[header.body_offset : header.body_offset + NONCE_BYTES]
        try:
            return cipher.decrypt(
                bytes(nonce),
                data[header.body_offset + NONCE_BYTES :],
                associated_data(purpose, tenant, key),
            )
        except InvalidTag:
            raise OpenError(
                "sealed value failed to open (another key, tenant or changed)"
            ) from None

    def needs_reseal(self, blob: bytes | memoryview) -> bool:
        """Whether blob is not sealed under the sealing key (older key, or in the clear)."""
        try:
            return read_header(blob).key_id != self.keyring.sealing_id
        except OpenError:
            return True
