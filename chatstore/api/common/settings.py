"""Server settings: API keys, limits and logging, read from the Config and CHATSTORE_* env.

The keys live beside the engine's in `Config` when it has them (`[server]` in the TOML file);
the environment always wins, in the forms the README documents:

    CHATSTORE_API_KEYS=key1:tenant1,key2:tenant2
    CHATSTORE_ADMIN_KEY=secret
    CHATSTORE_API_KEYS_FILE=/path/api_keys.json    (default <data_dir>/api_keys.json)

Plain keys are hashed as the settings are built (api_keys.py): afterwards `api_keys` is a
HashedKeys (admin key included) and `admin_key` is None, in this object and every copy
`dataclasses.replace` makes of it. The keys file (`chatstore keys add|list|revoke`) holds salted
hashes only; `key_file` checks presented keys against it and follows its changes.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chatstore.api.common.api_keys import HashedKeys, KeyVerifier, default_keys_file

if TYPE_CHECKING:
    from chatstore.config import Config

LOCAL_TENANT = "local"
# Turns in flight per tenant when keys are set and max_turns_per_tenant is 0 (auto): a tenant
# may not take more than this share of a 32-64 sequence batch from the others.
KEYED_TURNS_PER_TENANT = 16


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # Given as {plain key: tenant} and an admin key; held as HashedKeys from __post_init__ on.
    api_keys: Mapping[str, str] | HashedKeys = field(default_factory=HashedKeys, repr=False)
    admin_key: str | None = field(default=None, repr=False)
    api_keys_file: str = ""  # hashed keys (`chatstore keys`); "" here = none
    key_file: KeyVerifier | None = field(default=None, compare=False, repr=False)
    max_body_bytes: int = 1 << 20
    max_message_chars: int = 32_768
    max_messages: int = 512
    max_metadata_bytes: int = 16384
    max_sessions_per_tenant: int = 10000
    max_turns_per_tenant: int = 0  # 0 = auto: KEYED_TURNS_PER_TENANT with keys, none in local
    allowed_hosts: str = ""  # comma-separated, local mode only
    cors_origins: str = ""  # "*" or comma-separated origins
    metrics_auth: bool = False
    purge_interval_s: float = 60.0
    log_level: str = "info"
    model_name: str = "SmolLM2-135M-Instruct"
    default_max_tokens: int = 256
    retry_after_s: int = 1
    drain_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        hashed = self.api_keys if isinstance(self.api_keys, HashedKeys) else None
        if hashed is None or self.admin_key:
            plain = {} if hashed is not None else dict(self.api_keys)  # type: ignore[arg-type]
            fresh = HashedKeys.from_plain(plain, self.admin_key)
            object.__setattr__(self, "api_keys", (hashed or HashedKeys()).merged(fresh))
            object.__setattr__(self, "admin_key", None)
        if self.api_keys_file and self.key_file is None:
            object.__setattr__(self, "key_file", KeyVerifier(self.api_keys_file))

    @property
    def local_mode(self) -> bool:
        """No key configured (plain, admin or a keys file present at start): one user, no
        auth, loopback only. A keys file whose keys are all revoked still means keys: nobody
        gets in, rather than everybody."""
        return not self.api_keys and not (self.key_file and self.key_file.present_at_start)

    @property
    def turns_per_tenant(self) -> int | None:
        """The cap on one tenant's turns in flight, None for none. A per-tenant cap protects
        tenants from each other; in local mode there is one tenant, so it would only throttle
        the single user: the engine's own queue (max_running, max_waiting) bounds it instead."""
        if self.max_turns_per_tenant > 0:
            return self.max_turns_per_tenant
        return None if self.local_mode else KEYED_TURNS_PER_TENANT

    def check_bind(self) -> None:
        """Local (keyless) mode must not listen beyond loopback."""
        if self.local_mode and not is_loopback(self.host):
            raise ValueError(
                f"no API key configured: refusing to listen on {self.host}; set "
                "CHATSTORE_API_KEYS (and CHATSTORE_ADMIN_KEY) or bind to 127.0.0.1"
            )

    @classmethod
    def from_config(cls, config: Config, env: Mapping[str, str] | None = None) -> ServerSettings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            if hasattr(config, name):
                values[name] = getattr(config, name)
            raw = env.get(f"CHATSTORE_{name.upper()}")
            # host, port: Config read them already; key_file is built here, never given
            if raw is not None and name not in ("host", "port", "key_file"):
                values[name] = raw
        if "api_keys" in values:
            values["api_keys"] = parse_api_keys(values["api_keys"])
        values["admin_key"] = values.get("admin_key") or None
        # "" in the config means the data directory's file (a ServerSettings built by hand
        # has none unless given one).
        values["api_keys_file"] = values.get("api_keys_file") or str(default_keys_file(config, env))
        for name in (
            "port",
            "max_body_bytes",
            "max_message_chars",
            "max_messages",
            "max_metadata_bytes",
            "max_sessions_per_tenant",
            "max_turns_per_tenant",
        ):
            if name in values:
                values[name] = int(values[name])
        for name in ("default_max_tokens", "retry_after_s"):
            if name in values:
                values[name] = int(values[name])
        for name in ("drain_timeout_s", "purge_interval_s"):
            if name in values:
                values[name] = float(values[name])
        if isinstance(values.get("metrics_auth"), str):
            values["metrics_auth"] = values["metrics_auth"].lower() in ("1", "true", "yes", "on")
        return cls(**values)


def forget_plain_keys(config: Config, env: MutableMapping[str, str] | None = None) -> Config:
    """config without its plain keys, and CHATSTORE_API_KEYS / CHATSTORE_ADMIN_KEY gone from the
    environment (os.environ by default): once ServerSettings has hashed them, the serving
    process keeps no reference to a key in the clear (nor hands one to a child process)."""
    env = os.environ if env is None else env
    for name in ("CHATSTORE_API_KEYS", "CHATSTORE_ADMIN_KEY"):
        env.pop(name, None)
    if getattr(config, "api_keys", "") or getattr(config, "admin_key", ""):
        config = dataclasses.replace(config, api_keys="", admin_key="")
    return config


def parse_api_keys(raw: str | Mapping[str, str] | list[str]) -> dict[str, str]:
    """'key1:tenant1,key2:tenant2' (or a mapping, or a list of 'key:tenant') -> {key: tenant}."""
    if isinstance(raw, Mapping):
        return {str(k): str(v) for k, v in raw.items()}
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    keys: dict[str, str] = {}
    for position, item in enumerate((i.strip() for i in items), start=1):
        if not item:
            continue
        key, sep, tenant = item.partition(":")
        if not sep or not key or not tenant:
            # The entry is (or holds) a secret: name it by position, never echo it into a log.
            raise ValueError(
                f"API key entry {position} of {len(items)} is not of the form key:tenant"
            )
        keys[key] = tenant
    return keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
