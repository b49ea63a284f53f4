"""Checking a presented API key without holding any key in the clear.

Two sources, both consulted for every presentation:

* Plain keys from `CHATSTORE_API_KEYS` / `CHATSTORE_ADMIN_KEY` (or the config) are hashed when
  the settings are built (HashedKeys): HMAC-SHA256 under a pepper drawn at random per process,
  so a memory or core dump taken later holds digests only, useless without the pepper and
  useless in any other process. A presented key is HMAC'd once and compared, in constant time,
  with every digest, so the time taken says nothing about which key it resembled.
* The keys file (key_file.py): salted scrypt hashes, several per tenant, added and revoked with
  `chatstore keys` while the server runs; the file is re-read when it changes (one stat per
  check). A presented `csk_<id>_<secret>` is checked against record <id> alone. Keys verified
  once are remembered by their peppered HMAC (never the key), so scrypt runs on a key's first
  use only; a revoked or removed key is refused at its next use since the record is looked up
  again every time.

KeyVerifier.check gives a Verdict: the tenant (or the admin), or why the key was refused
("invalid": unknown; "revoked": a revoked file key with the right secret).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from chatstore.api.common.key_file import FileStamp, KeyFile, KeyFileError, KeyRecord, parse_key

if TYPE_CHECKING:
    from chatstore.config import Config

log = logging.getLogger(__name__)

_PEPPER = secrets.token_bytes(32)  # this process's: digests never leave it
_MAX_REMEMBERED = 4096  # verified file keys remembered (a bound, not a tuning knob)


def peppered(key: str) -> bytes:
    return hmac.new(_PEPPER, key.encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class HashedKeys:
    """Plain configured keys, as peppered digests: (digest, tenant) pairs and admin digests."""

    tenants: tuple[tuple[bytes, str], ...] = ()
    admins: tuple[bytes, ...] = ()

    @classmethod
    def from_plain(cls, keys: Mapping[str, str], admin_key: str | None = None) -> HashedKeys:
        tenants = tuple((peppered(key), tenant) for key, tenant in keys.items())
        return cls(tenants, (peppered(admin_key),) if admin_key else ())

    def merged(self, other: HashedKeys) -> HashedKeys:
        return HashedKeys(self.tenants + other.tenants, self.admins + other.admins)

    def match(self, digest: bytes) -> Verdict | None:
        """The key's verdict, or None; every digest is compared whatever matches."""
        found: Verdict | None = None
        for admin in self.admins:
            if hmac.compare_digest(digest, admin):
                found = Verdict("admin", True)
        for candidate, tenant in self.tenants:
            if hmac.compare_digest(digest, candidate) and found is None:
                found = Verdict(tenant, False)
        return found

    def __len__(self) -> int:  # tenant keys, as the start-up log line counts them
        return len(self.tenants)

    def __bool__(self) -> bool:
        return bool(self.tenants or self.admins)

    def __repr__(self) -> str:
        return f"HashedKeys({len(self.tenants)} tenant keys, {len(self.admins)} admin keys)"


@dataclass(frozen=True)
class Verdict:
    tenant: str | None
    is_admin: bool = False
    refused: str | None = None  # "invalid" | "revoked" when tenant is None


INVALID = Verdict(None, refused="invalid")


def default_keys_file(config: Config, env: Mapping[str, str] | None = None) -> Path:
    """Where the keys file is when `api_keys_file` is not set: <data_dir>/api_keys.json, the
    data directory resolved as the store resolves it."""
    env = os.environ if env is None else env
    if getattr(config, "api_keys_file", ""):
        return Path(config.api_keys_file).expanduser()
    data_dir = getattr(config, "data_dir", "") or env.get("CHATSTORE_DATA_DIR", "")
    if data_dir:
        return Path(data_dir).expanduser() / "api_keys.json"
    from chatstore.model.default_model import chatstore_home

    return chatstore_home() / "data" / "api_keys.json"


class KeyVerifier:
    """The keys file, as the server checks keys against it (see the module doc)."""

    def __init__(self, path: str | Path) -> None:
        self.file = KeyFile(path)
        self.present_at_start = self.file.exists()
        self._lock = threading.Lock()
        self._stamp: FileStamp | None = None
        self._records: dict[str, KeyRecord] = {}
        self._verified: dict[bytes, str] = {}  # peppered key -> key id
        self._refresh()  # an unsafe or malformed file stops the server here, not at a request

    def check(self, presented: str, digest: bytes) -> Verdict:
        parsed = parse_key(presented)
        if parsed is None:
            return INVALID
        key_id, secret = parsed
        with self._lock:
            self._refresh_quietly()
            record = self._records.get(key_id)
            remembered = self._verified.get(digest) == key_id
        if record is None:
            return INVALID
        if not remembered and not record.matches(secret):
            return INVALID
        if not record.active:
            return Verdict(None, refused="revoked")
        if not remembered:
            with self._lock:
                if len(self._verified) >= _MAX_REMEMBERED:
                    self._verified.clear()
                self._verified[digest] = key_id
        return Verdict("admin", True) if record.admin else Verdict(record.tenant)

    def _refresh_quietly(self) -> None:
        """While serving, a file made unsafe or malformed is logged and the keys read last stay
        in force (no 500s); the next valid version of the file is read as usual."""
        try:
            self._refresh()
        except KeyFileError as exc:
            self._stamp = self.file.stamp()  # log once per version of the file
            log.error("%s; the keys read before stay in force", exc)

    def _refresh(self) -> None:
        """Re-read the file if it was replaced since (caller holds the lock, or __init__)."""
        stamp = self.file.stamp()
        if stamp == self._stamp:
            return
        records = self.file.load()
        self._records = {r.id: r for r in records}
        self._stamp = stamp
        log.info("API keys file %s: %d active keys", self.file.path, sum(r.active for r in records))
