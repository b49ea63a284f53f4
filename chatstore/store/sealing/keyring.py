"""Server secrets and the per-tenant keys derived from them.

    secret   32 random bytes with a key id ("k1"); several for rotation, the first seals
    tenant   HKDF-SHA256(secret, salt=SALT, info="<tenant>\\0<generation>") -> 32-byte AES key

Keys are derived, never stored: what must be kept (and shared by replicas) is the secret. The
secret comes from `CHATSTORE_SECRET_KEY` / `secret_key` ("id:base64,id:base64"), else a key file
("id:base64" per line, mode 0600), else `<data_dir>/secret.key`, generated on first start.

Crypto-shredding bumps a tenant's generation in `<data_dir>/shredded.json` (written atomically
and fsynced; with Redis also in a hash replicas share, shared_shreds.py): the key its values
were sealed under is never derived again, so they stop opening everywhere at once, and the
tenant's later data is sealed under a fresh key.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import secrets
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from chatstore.private_file import write_private

log = logging.getLogger(__name__)

SALT = b"chatstore-at-rest-v1"
SECRET_BYTES = 32
KEY_FILE_NAME = "secret.key"
SHRED_FILE_NAME = "shredded.json"
MAX_KEY_ID = 32  # bytes: the id is stored in every sealed value


class KeyringError(ValueError):
    """The secrets given cannot be used (bad format, short, a key file others can read)."""


@dataclass(frozen=True)
class Secret:
    key_id: str
    material: bytes = field(repr=False)


def parse_secrets(text: str, where: str) -> list[Secret]:
    """`id:base64` entries separated by commas or newlines (blank lines and # comments skipped)."""
    out: list[Secret] = []
    for raw in text.replace(",", "\n").splitlines():
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        key_id, colon, b64 = entry.partition(":")
        key_id = key_id.strip()
        if not colon or not key_id:
            raise KeyringError(f"{where}: each secret is 'id:base64', got an entry without an id")
        if len(key_id.encode()) > MAX_KEY_ID:
            raise KeyringError(f"{where}: key id {key_id!r} is over {MAX_KEY_ID} bytes")
        try:
            material = base64.b64decode(b64.strip(), validate=True)
        except binascii.Error:
            raise KeyringError(f"{where}: secret {key_id!r} is not valid base64") from None
        if len(material) < SECRET_BYTES:
            raise KeyringError(
                f"{where}: secret {key_id!r} has {len(material)} bytes, at least {SECRET_BYTES}"
            )
        if any(s.key_id == key_id for s in out):
            raise KeyringError(f"{where}: key id {key_id!r} given twice")
        out.append(Secret(key_id, material))
    if not out:
        raise KeyringError(f"{where}: no secret")
    return out


def new_secret_line(key_id: str = "k1") -> str:
    return f"{key_id}:{base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()}"


def read_key_file(path: Path) -> list[Secret]:
    """The secrets in path; KeyringError if group or others may read it."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise KeyringError(
            f"secret key file {path} has mode {mode:o}: it must be readable by its owner only "
            f"(chmod 600 {path})"
        )
    return parse_secrets(path.read_text(), str(path))


class Keyring:
    """The secrets (first = sealing) and the tenants' shred generations; derived keys cached."""

    def __init__(self, secrets_: list[Secret], shred_file: Path | None = None) -> None:
        if not secrets_:
            raise KeyringError("a keyring needs at least one secret")
        self.secrets = {s.key_id: s for s in secrets_}
        self.sealing_id = secrets_[0].key_id
        self.shred_file = shred_file
        self._generations: dict[str, int] = self._read_generations()
        self._cache: dict[tuple[str, str, int], AESGCM] = {}
        self._lock = threading.Lock()
        self.shared: Any = None  # SharedShreds: the shred list replicas share in Redis

    @property
    def key_ids(self) -> list[str]:
        return list(self.secrets)

    def _read_generations(self) -> dict[str, int]:
        if self.shred_file is None or not self.shred_file.exists():
            return {}
        data = json.loads(self.shred_file.read_text())
        return {str(t): int(g) for t, g in data.get("generations", {}).items()}

    def generation(self, tenant: str) -> int:
        return self._generations.get(tenant, 0)

    def cipher(self, key_id: str, tenant: str) -> AESGCM | None:
        """The AES-GCM cipher of tenant's key under secret key_id (None: no such secret)."""
        gen = self.generation(tenant)
        cached = self._cache.get((key_id, tenant, gen))
        if cached is not None:
            return cached
        secret = self.secrets.get(key_id)
        if secret is None:
            return None
        info = tenant.encode() + b"\0" + str(gen).encode()
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=SALT, info=info)
        cipher = AESGCM(hkdf.derive(secret.material))
        with self._lock:
            self._cache[(key_id, tenant, gen)] = cipher
        return cipher

    def shred(self, tenant: str) -> int:
        """Destroy tenant's current key: its generation goes up, persisted before this returns
        (so a crash right after still never derives the old key), and shared with the other
        replicas when a shared list is set (its error is raised, the local shred stands).
        The new generation."""
        if self.shared is not None:
            self.shared.pull()  # another replica may have shredded it meanwhile
        gen = self.generation(tenant) + 1
        self._adopt({tenant: gen})
        log.warning("tenant %r: its data key was destroyed (crypto-shredded)", tenant)
        if self.shared is not None:
            self._adopt({tenant: self.shared.publish(tenant, gen)})
        return self.generation(tenant)

    def merge_generations(self, seen: dict[str, int]) -> list[str]:
        """Adopt the higher of each tenant's generations (another replica's shreds); the
        tenants whose key changed."""
        changed = {t: g for t, g in seen.items() if g > self.generation(t)}
        if changed:
            self._adopt(changed)
        return sorted(changed)

    def _adopt(self, generations: dict[str, int]) -> None:
        """Raise these tenants' generations: written to the shred file, then used."""
        with self._lock:
            merged = dict(self._generations)
            for tenant, gen in generations.items():
                merged[tenant] = max(gen, merged.get(tenant, 0))
            if merged == self._generations:
                return
            if self.shred_file is not None:
                self.shred_file.parent.mkdir(parents=True, exist_ok=True)
                write_private(self.shred_file, json.dumps({"generations": merged}))
            self._generations = merged
            self._cache = {k: v for k, v in self._cache.items() if k[1] not in generations}


def load_keyring(data_dir: Path, secret_key: str = "", secret_key_file: str = "") -> Keyring:
    """The server's keyring: secret_key (text), else secret_key_file, else the generated
    `<data_dir>/secret.key` (made on first start)."""
    shreds = data_dir / SHRED_FILE_NAME
    if secret_key.strip():
        return Keyring(parse_secrets(secret_key, "CHATSTORE_SECRET_KEY"), shreds)
    if secret_key_file:
        path = Path(secret_key_file).expanduser()
        if not path.is_file():
            raise KeyringError(f"secret_key_file {path} does not exist")
        return Keyring(read_key_file(path), shreds)
    path = data_dir / KEY_FILE_NAME
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        write_private(path, new_secret_line() + "\n")
        log.warning(
            "encryption at rest: generated a new server secret in %s (mode 0600). Back it up "
            "apart from the data: without it nothing stored can be read. Replicas must share "
            "one secret (CHATSTORE_SECRET_KEY).",
            path,
        )
    return Keyring(read_key_file(path), shreds)
