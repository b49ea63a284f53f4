"""The errors of encryption at rest that reach the API (a plain value module: the API maps them
to HTTP statuses without importing the keyring)."""

from __future__ import annotations


class KeyringError(ValueError):
    """The secrets given cannot be used (bad format, short, a key file others can read, a key
    file inside the data directory, a generated key where replicas need a shared one)."""


class KeyUnavailable(KeyringError):
    """A tenant's data key exists but this server cannot unwrap it (another master key, or one
    it lacks): it must not seal that tenant's values (the key store is never overwritten)."""


class ShredFailed(RuntimeError):
    """The key store did not take a shred (Redis out of reach): nothing was destroyed or
    purged; retry once it is back."""
