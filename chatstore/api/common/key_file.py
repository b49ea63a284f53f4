"""The API keys file: each key held as a salted scrypt hash, managed by `chatstore keys`.

    <data_dir>/api_keys.json   (or `api_keys_file`), mode 0600, replaced atomically
    {"version": 1, "keys": [{"id": "3f9c0a1b2c4d", "tenant": "alice", "admin": false,
      "created": 1764106800.0, "revoked": null, "kdf": "scrypt", "n": 16384, "r": 8, "p": 1,
      "salt": "<32 hex>", "hash": "<64 hex>"}, ...]}

A key is `csk_<id>_<secret>`: the id (12 hex digits, not secret: `keys list` shows it) names the
record to check, so one scrypt runs per presentation, not one per stored key; the secret is 32
random bytes (urlsafe base64). It is shown once, by `keys add`, and never stored. scrypt
(hashlib's, OpenSSL's) with n=2^14, r=8, p=1 costs ~40 ms and 16 MiB: a stolen file gives an
attacker nothing to test guesses against cheaply, though 256 random bits would need no slow hash;
the verifier (api_keys.py) remembers keys it verified, so only a key's first use pays it.

Several keys per tenant are the point: add the new key, move clients over, revoke the old one;
the server re-reads the file when it changes (no restart). A revoked key stays listed with its
revocation time. Writers (the CLI) take an flock on `<file>.lock` around read-modify-write, and
write a temporary file they rename over the old one, so a server never reads half a file.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from chatstore.private_file import write_private

KEY_PREFIX = "csk"
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 14, 8, 1
SCRYPT_MAXMEM = 64 << 20
FILE_VERSION = 1


class KeyFileError(ValueError):
    """The keys file is unsafe (writable by others), unreadable or malformed."""


@dataclass(frozen=True)
class KeyRecord:
    id: str
    tenant: str
    admin: bool
    created: float
    revoked: float | None
    salt: str  # hex
    hash: str  # hex scrypt of the key's secret part
    kdf: str = "scrypt"
    n: int = SCRYPT_N
    r: int = SCRYPT_R
    p: int = SCRYPT_P

    @property
    def active(self) -> bool:
        return self.revoked is None

    def matches(self, secret: str) -> bool:
        """Whether secret is this key's (compared in constant time)."""
        computed = scrypt_hash(secret, bytes.fromhex(self.salt), self.n, self.r, self.p)
        return secrets.compare_digest(computed, bytes.fromhex(self.hash))


@dataclass(frozen=True)
class NewKey:
    record: KeyRecord
    key: str  # the full key, to hand to the client once; never stored


def scrypt_hash(secret: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=salt, n=n, r=r, p=p, maxmem=SCRYPT_MAXMEM, dklen=32)


def format_key(key_id: str, secret: str) -> str:
    return f"{KEY_PREFIX}_{key_id}_{secret}"


def parse_key(presented: str) -> tuple[str, str] | None:
    """`csk_<id>_<secret>` -> (id, secret); None for anything else (e.g. a plain env key)."""
    prefix, _, rest = presented.partition("_")
    key_id, _, secret = rest.partition("_")
    if prefix != KEY_PREFIX or len(key_id) != 12 or not secret:
        return None
    if any(c not in "0123456789abcdef" for c in key_id):
        return None
    return key_id, secret


def new_key(tenant: str, admin: bool = False) -> NewKey:
    if not tenant or tenant != tenant.strip():
        raise ValueError("a key needs a tenant name without surrounding spaces")
    key_id = secrets.token_hex(6)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
    salt = secrets.token_bytes(16)
    digest = scrypt_hash(secret, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    record = KeyRecord(key_id, tenant, admin, time.time(), None, salt.hex(), digest.hex())
    return NewKey(record, format_key(key_id, secret))


@dataclass(frozen=True)
class FileStamp:
    """What changes when the file is replaced: re-read when it differs."""

    inode: int
    mtime_ns: int
    size: int


class KeyFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()

    def exists(self) -> bool:
        return self.path.is_file()

    def stamp(self) -> FileStamp | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return FileStamp(st.st_ino, st.st_mtime_ns, st.st_size)

    def load(self) -> list[KeyRecord]:
        """The records ([] without a file). KeyFileError when the file is writable by group or
        others (anyone who can write it can add a key) or is not a keys file."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise KeyFileError(f"cannot read the API keys file {self.path}: {exc}") from None
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise KeyFileError(f"the API keys file {self.path} is not a regular file")
            if st.st_mode & 0o022:
                raise KeyFileError(
                    f"the API keys file {self.path} is writable by group or others "
                    f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it"
                )
            raw = fh.read()
        try:
            doc = json.loads(raw)
            if doc.get("version") != FILE_VERSION:
                raise ValueError(f"version {doc.get('version')!r}")
            return [KeyRecord(**entry) for entry in doc["keys"]]
        except (ValueError, TypeError, KeyError) as exc:
            raise KeyFileError(f"the API keys file {self.path} is malformed: {exc}") from None

    def add(self, tenant: str, admin: bool = False) -> NewKey:
        made = new_key(tenant, admin)
        with self._locked():
            self._write([*self.load(), made.record])
        return made

    def revoke(self, key_id: str) -> KeyRecord:
        """Mark key_id revoked (it stays listed); KeyError if there is no such key."""
        with self._locked():
            records = self.load()
            for i, record in enumerate(records):
                if record.id == key_id:
                    if record.active:
                        records[i] = replace(record, revoked=time.time())
                        self._write(records)
                    return records[i]
        raise KeyError(key_id)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _write(self, records: list[KeyRecord]) -> None:
        doc = {"version": FILE_VERSION, "keys": [asdict(r) for r in records]}
        data = json.dumps(doc, indent=1).encode()
        write_private(self.path, data)
