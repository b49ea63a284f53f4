"""The master key: where it comes from, and where it may never be.

    1. CHATSTORE_SECRET_KEY (or `secret_key`)       "id:base64,id:base64", the first wraps
    2. --secret-file (or `secret_key_file`)         one "id:base64" per line, mode 0600
    3. $XDG_CONFIG_HOME/chatstore/secret.key        (default ~/.config/chatstore/secret.key),
                                                    generated (0600) on a local server's first
                                                    start, and the log says where

The master key only wraps the tenants' data keys (keyring.py); it never seals data itself. It
must never sit in the data directory: whoever copies the directory (or a backup of it) would
hold the key to everything in it. A start refuses a key file inside the data directory (the
error names both paths), including the `<data_dir>/secret.key` earlier versions generated. With
replicas (a Redis URL) a generated key is refused too: every replica must be given the same one.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from chatstore.private_file import write_private
from chatstore.store.sealing.errors import KeyringError

log = logging.getLogger(__name__)

SECRET_BYTES = 32
MAX_KEY_ID = 32  # bytes: the id is stored with every wrapped data key
KEY_FILE_NAME = "secret.key"
# The version-1 secret sealed the records written before envelope keys (legacy_v1.py).
LEGACY_HINT = (
    ". It is the secret of version 1: records sealed under it read as absent until "
    "`chatstore admin migrate-v1` re-seals them; give it to that migration, once moved, as "
    "CHATSTORE_LEGACY_SECRET_FILE (docs/security.md)"
)


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


def default_key_path() -> Path:
    """$XDG_CONFIG_HOME/chatstore/secret.key, ~/.config/chatstore/secret.key without it."""
    config_home = os.environ.get("XDG_CONFIG_HOME", "").strip()
    base = Path(config_home) if config_home else Path.home() / ".config"
    return base.expanduser() / "chatstore" / KEY_FILE_NAME


def refuse_inside(path: Path, data_dir: Path, hint: str = "") -> None:
    """KeyringError when path lies inside data_dir (symlinks resolved); hint: said after."""
    key, data = path.expanduser().resolve(), data_dir.expanduser().resolve()
    if key == data or data in key.parents:
        raise KeyringError(
            f"the master key file {key} is inside the data directory {data}: a copy or backup "
            f"of the data directory would carry the key to its data. Move it out (for example "
            f"to {default_key_path()}) and point secret_key_file / --secret-file at it, or set "
            f"CHATSTORE_SECRET_KEY{hint}"
        )


def load_master_secrets(
    data_dir: Path, secret_key: str = "", secret_key_file: str = "", replicas: bool = False
) -> list[Secret]:
    """The master secrets (first = the one that wraps), in the order of the module doc.
    replicas: a Redis URL is configured, so a secret generated here is refused."""
    if secret_key.strip():
        return parse_secrets(secret_key, "CHATSTORE_SECRET_KEY")
    if secret_key_file:
        path = Path(secret_key_file).expanduser()
        refuse_inside(path, data_dir)
        if not path.is_file():
            raise KeyringError(f"secret_key_file {path} does not exist")
        return read_key_file(path)
    legacy = data_dir / KEY_FILE_NAME
    if legacy.exists():  # what earlier versions generated: never read from there again
        refuse_inside(legacy, data_dir, LEGACY_HINT)
    path = default_key_path()
    refuse_inside(path, data_dir)
    if path.exists():
        return read_key_file(path)
    if replicas:
        raise KeyringError(
            f"no master key: with Redis every replica must be given the same one "
            f"(CHATSTORE_SECRET_KEY or --secret-file); none is generated ({path} does not exist)"
        )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(path, new_secret_line() + "\n")
    log.warning(
        "encryption at rest: generated a new master key in %s (mode 0600). Back it up apart "
        "from the data and its backups: without it nothing stored can be read.",
        path,
    )
    return read_key_file(path)
