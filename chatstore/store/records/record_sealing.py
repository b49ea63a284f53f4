"""A record store's sealing: every value it stores sealed under its tenant's key, its storage name
the associated data (sealing/sealer.py), and what happens to a value that does not open.

A value that fails to open (a wrong or shredded key, a changed byte, a value moved under another
name) reads as absent and is counted in `open_failures`: it is never served, and it never turns
into an error. One sealed by version 1 (before the keyring) says how to migrate it, once.

Re-sealing rewrites a stored value under the tenant's current sealing key: data-key rotation,
encrypt-existing (`adopt_clear`: the operator's conversion of values written in the clear) and
migrate-v1 (`legacy`: version-1 values opened under the legacy secret). The backends walk their
values (`reseal_all`) and ask `reseal` for each one.
"""

from __future__ import annotations

import json
import logging

from chatstore.store.sealing import RECORD_PURPOSE, OpenError, Sealer
from chatstore.store.sealing.legacy_v1 import HOW_TO_MIGRATE, LegacyOpener, is_legacy_sealed
from chatstore.store.sealing.sealer import is_sealed, owner_tenant

log = logging.getLogger(__name__)


class RecordSealing:
    """The sealer of one record store (None: records in the clear) and its count of values that
    failed to open (the store's `open_failures`, counted by its readers too)."""

    def __init__(self, sealer: Sealer | None) -> None:
        self.sealer = sealer
        self.open_failures = 0  # records that failed to open (read as absent)
        self._told_legacy = False  # the version-1 migration hint is logged once

    def seal(self, tenant: str, name: bytes, raw: bytes) -> bytes:
        if self.sealer is None:
            return raw
        return bytes(self.sealer.seal(RECORD_PURPOSE, tenant, name, raw))

    def unseal(self, tenant: str, name: bytes, raw: bytes | None) -> bytes | None:
        """raw opened (None when absent or when it fails to open: counted, read as absent)."""
        if raw is None or self.sealer is None:
            return raw
        try:
            return self.sealer.open(RECORD_PURPOSE, tenant, name, raw)
        except OpenError as exc:
            self.open_failures += 1
            log.warning("record %r failed to open (%s): read as absent", name, exc)
            if not self._told_legacy and is_legacy_sealed(raw):
                self._told_legacy = True
                log.warning("records sealed by version 1 read as absent: %s", HOW_TO_MIGRATE)
            return None

    def digest_key(self, tenant: str) -> bytes:
        """The key of tenant's prefix index hashes (prefix_index.py): its digest key when
        sealing, b"" (unkeyed) in the clear."""
        if self.sealer is None:
            return b""
        return self.sealer.keyring.digest_key(owner_tenant(tenant))

    def index_mark(self) -> bytes:
        """What a backend's "prefix index built" marker holds: an index built keyed (or not)
        is built again when that changes, or when it was built before keyed hashes."""
        return b"2:keyed" if self.sealer is not None else b"2:plain"

    def reseal(
        self,
        tenant: str,
        name: bytes,
        raw: bytes,
        adopt_clear: bool = False,
        legacy: LegacyOpener | None = None,
    ) -> bytes | None:
        """raw re-sealed under its tenant's sealing data key when it is under an older one
        (data-key rotation); None when it needs nothing or does not open (counted, left as
        it is). A value in the clear is never accepted here, except by `adopt_clear`
        (encrypt-existing: the operator's explicit conversion of data written with
        encrypt_at_rest = false), which seals clear JSON and leaves sealed values alone.
        `legacy` (migrate-v1): only version-1 values, opened under the legacy secret, are
        sealed again (as version 2); every other value is left alone. Any record kind (a
        session, a stored Response): the JSON is checked, not its fields."""
        sealer = self.sealer
        if sealer is None:
            return None
        if legacy is not None:
            plain = self._open_legacy(legacy, tenant, name, raw)
        elif is_sealed(raw):
            if adopt_clear or not sealer.needs_reseal(tenant, raw):
                return None
            plain = self.unseal(tenant, name, raw)  # counted when it does not open
        else:
            plain = raw if adopt_clear and raw.startswith(b"{") else None
        if plain is None:
            return None
        try:
            json.loads(plain)
        except ValueError:
            return None
        return bytes(sealer.seal(RECORD_PURPOSE, tenant, name, plain))

    def _open_legacy(
        self, legacy: LegacyOpener, tenant: str, name: bytes, raw: bytes
    ) -> bytes | None:
        """A version-1 value's plaintext (None: not one, or it does not open: counted)."""
        if not is_legacy_sealed(raw):
            return None  # version 2, or clear: never adopted by the migration
        try:
            return legacy.open(RECORD_PURPOSE, tenant, name, raw)
        except OpenError as exc:
            self.open_failures += 1
            log.warning("version-1 record %r not migrated (%s): left as it is", name, exc)
            return None
