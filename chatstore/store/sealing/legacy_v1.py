"""Opening values sealed by version 1 (before envelope keys), for the records' migration only.

    0        1         2           2+n      14+n
    | 0x01    | id len n | secret id | nonce (12) | ciphertext + tag (16) |

    key  = HKDF-SHA256(secret, salt = "chatstore-at-rest-v1",
                       info = "<tenant>\\0<generation>", 32 bytes)
    ad   = "<purpose>\\0<tenant>\\0<key>"        (as version 2: sealer.associated_data)

A version-1 tenant key was derived from the server secret (`<data_dir>/secret.key` by default)
and the tenant's shred generation (`<data_dir>/shredded.json`, and with replicas the Redis hash
`chatstore:shred`; an absent tenant is generation 0). A shred raised the generation, so a
tenant shredded under version 1 has a generation its values were not sealed under: they stay
unopenable here too, as they must.

Nothing here seals: the migration (`chatstore admin migrate-v1`, reseal.py) opens a record
with these keys and seals it again as a version-2 value under its tenant's data key. The
legacy secret is given to the server process, never over the admin API, like the master key:
CHATSTORE_LEGACY_SECRET_KEY ("id:base64,...") or CHATSTORE_LEGACY_SECRET_FILE (a 0600 file
outside the data directory: the old `<data_dir>/secret.key`, moved out).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from chatstore.store.sealing.errors import KeyringError
from chatstore.store.sealing.master_key import Secret, parse_secrets, read_key_file, refuse_inside
from chatstore.store.sealing.sealer import OpenError, associated_data, owner_tenant

log = logging.getLogger(__name__)

VERSION = 1
NONCE_BYTES = 12
TAG_BYTES = 16
SALT = b"chatstore-at-rest-v1"
SHRED_FILE_NAME = "shredded.json"
SHARED_SHREDS = "chatstore:shred"  # the replicas' shred generations (Redis hash)
SECRET_ENV = "CHATSTORE_LEGACY_SECRET_KEY"
SECRET_FILE_ENV = "CHATSTORE_LEGACY_SECRET_FILE"
HOW_TO_MIGRATE = (
    f"give the server the old secret ({SECRET_FILE_ENV}=<the old <data_dir>/secret.key, moved "
    f"out of the data directory>, or {SECRET_ENV}) and run `chatstore admin migrate-v1`"
)


def is_legacy_sealed(blob: bytes | bytearray | memoryview) -> bool:
    """Whether blob has the shape of a version-1 sealed value (it may still not open)."""
    data = memoryview(blob)
    if len(data) < 2 or data[0] != VERSION:
        return False
    n = data[1]
    return n > 0 and len(data) >= 2 + n + NONCE_BYTES + TAG_BYTES


class LegacyOpener:
    """Opens version-1 values under the legacy secrets and the tenants' shred generations."""

    def __init__(self, secrets: list[Secret], generations: Mapping[str, int]) -> None:
        if not secrets:
            raise KeyringError("the version-1 migration needs the old secret")
        self.secrets = {s.key_id: s for s in secrets}
        self.generations = dict(generations)
        self._ciphers: dict[tuple[str, str], AESGCM] = {}
        self._lock = threading.Lock()

    def _cipher(self, key_id: str, tenant: str) -> AESGCM | None:
        cached = self._ciphers.get((key_id, tenant))
        if cached is not None:
            return cached
        secret = self.secrets.get(key_id)
        if secret is None:
            return None
        generation = self.generations.get(tenant, 0)
        info = tenant.encode() + b"\0" + str(generation).encode()
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=SALT, info=info)
        cipher = AESGCM(hkdf.derive(secret.material))
        with self._lock:
            self._ciphers[(key_id, tenant)] = cipher
        return cipher

    def open(self, purpose: bytes, tenant: str, key: bytes, blob: bytes | memoryview) -> bytes:
        """The plaintext of a version-1 value sealed for (purpose, tenant, key); OpenError when
        it is none, names a secret not given, or fails to authenticate (another key, tenant or
        name, a bumped generation, a changed byte)."""
        data = memoryview(blob)
        if not is_legacy_sealed(data):
            raise OpenError("not a version-1 sealed value")
        start = 2 + data[1]
        try:
            key_id = bytes(data[2:start]).decode()
        except UnicodeDecodeError:
            raise OpenError("version-1 value: bad key id") from None
        cipher = self._cipher(key_id, owner_tenant(tenant))
        if cipher is None:
            raise OpenError(f"version-1 value sealed under secret {key_id!r}, which was not given")
        nonce = bytes(data[start : start + NONCE_BYTES])
        try:
            return cipher.decrypt(
                nonce, data[start + NONCE_BYTES :], associated_data(purpose, tenant, key)
            )
        except InvalidTag:
            raise OpenError(
                "version-1 value failed to open (another secret, tenant or generation, or changed)"
            ) from None


def shred_generations(data_dir: Path, redis_client: Any = None) -> dict[str, int]:
    """Each tenant's version-1 shred generation: the higher of `<data_dir>/shredded.json`'s and
    the replicas' shared hash (when the records are in Redis). A generation is never lowered:
    taking the higher keeps a tenant shredded anywhere unopenable."""
    found: dict[str, int] = {}
    path = data_dir / SHRED_FILE_NAME
    if path.exists():
        data = json.loads(path.read_text())
        found = {str(t): int(g) for t, g in data.get("generations", {}).items()}
    if redis_client is not None:
        for raw_tenant, raw_gen in redis_client.hgetall(SHARED_SHREDS).items():
            tenant = raw_tenant.decode() if isinstance(raw_tenant, bytes) else raw_tenant
            found[tenant] = max(found.get(tenant, 0), int(raw_gen))
    return found


def legacy_secrets(data_dir: Path, environ: Mapping[str, str] | None = None) -> list[Secret]:
    """The legacy secrets given to this process (SECRET_ENV, else SECRET_FILE_ENV: 0600, never
    inside the data directory); KeyringError saying how to give them when there are none."""
    env = os.environ if environ is None else environ
    text = env.get(SECRET_ENV, "")
    if text.strip():
        return parse_secrets(text, SECRET_ENV)
    file = env.get(SECRET_FILE_ENV, "").strip()
    if not file:
        raise KeyringError(
            f"the version-1 migration needs the secret those values were sealed with: start "
            f"the server with {SECRET_FILE_ENV}=<the old <data_dir>/secret.key, moved out of "
            f"the data directory> (or {SECRET_ENV}), then run it again"
        )
    path = Path(file).expanduser()
    refuse_inside(path, data_dir)
    if not path.is_file():
        raise KeyringError(f"{SECRET_FILE_ENV}: {path} does not exist")
    return read_key_file(path)


def opener_from_environment(data_dir: Path, redis_client: Any = None) -> LegacyOpener:
    """The migration's opener: the legacy secrets of this process's environment and the shred
    generations as they are now (read when the job starts or resumes)."""
    return LegacyOpener(legacy_secrets(data_dir), shred_generations(data_dir, redis_client))


def warn_if_legacy(where: str, sample: list[bytes]) -> int:
    """Log what to do when values of `sample` (a few stored records) are sealed by version 1;
    how many are."""
    legacy = sum(is_legacy_sealed(raw) for raw in sample)
    if legacy:
        log.warning(
            "%s: %d of the %d records looked at are sealed by version 1 (keys derived from the "
            "old secret): they read as absent until migrated; %s",
            where, legacy, len(sample), HOW_TO_MIGRATE,
        )  # fmt: skip
    return legacy
