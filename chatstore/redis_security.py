"""How we reach Redis safely: TLS (`rediss://`, `rediss+cluster://`) and AUTH / ACL credentials.

    redis_url              = "rediss://redis.internal:6380/0"
    redis_tls_ca_file      = "/etc/chatstore/redis-ca.pem"     the CA that signed Redis's cert
    redis_tls_cert_file    = "/etc/chatstore/client.pem"       client cert (tls-auth-clients yes)
    redis_tls_key_file     = "/etc/chatstore/client.key"
    redis_username         = "chatstore"                       an ACL user (AUTH user pass)
    redis_password         = ...                               better: CHATSTORE_REDIS_PASSWORD

Each has a CHATSTORE_* variable (config.py). A user and password in the URL work too; these win
over them. The server's certificate is always verified (redis-py's `ssl_cert_reqs=required`):
against the CA file, or the system's CAs without one, and its name against the URL's host unless
`redis_tls_check_hostname = false` (certificates that name no host, e.g. made for an IP that
changes). A certificate that does not verify fails the TLS handshake, which redis-py raises as a
ConnectionError: an outage to the tiers' breaker, so the server serves from its local tiers.

TLS options without a `rediss` URL are an error rather than a plain connection: a config that
names a CA means the operator expects the traffic encrypted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


def is_tls_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in ("rediss", "rediss+cluster")


@dataclass(frozen=True)
class RedisSecurity:
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    check_hostname: bool = True
    username: str = ""
    password: str = ""

    @classmethod
    def from_config(cls, config: Any) -> RedisSecurity:
        return cls(
            ca_file=config.redis_tls_ca_file,
            cert_file=config.redis_tls_cert_file,
            key_file=config.redis_tls_key_file,
            check_hostname=config.redis_tls_check_hostname,
            username=config.redis_username,
            password=config.redis_password,
        )

    @property
    def uses_tls_files(self) -> bool:
        return bool(self.ca_file or self.cert_file or self.key_file)

    def __repr__(self) -> str:  # the password stays out of logs and tracebacks
        shown = "***" if self.password else ""
        return (
            f"RedisSecurity(ca_file={self.ca_file!r}, cert_file={self.cert_file!r}, "
            f"key_file={self.key_file!r}, check_hostname={self.check_hostname}, "
            f"username={self.username!r}, password={shown!r})"
        )

    def validate(self, url: str) -> None:
        """Raise ValueError for options that cannot work together (before any connection)."""
        if self.uses_tls_files and url and not is_tls_url(url):
            raise ValueError(
                "redis_tls_* options are set but redis_url is not rediss:// (or "
                "rediss+cluster://): refusing to send them to Redis in the clear"
            )
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("redis_tls_cert_file and redis_tls_key_file go together")
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path and not Path(path).expanduser().is_file():
                raise ValueError(f"redis_tls_{name} {path} is not a readable file")

    def client_kwargs(self, url: str) -> dict[str, Any]:
        """Keyword arguments for redis.Redis.from_url / RedisCluster: credentials always (when
        set), ssl_* only for a TLS URL (a plain Connection takes no ssl_* argument)."""
        self.validate(url)
        kwargs: dict[str, Any] = {}
        if self.username:
            kwargs["username"] = self.username
        if self.password:
            kwargs["password"] = self.password
        if not is_tls_url(url):
            return kwargs
        kwargs["ssl_cert_reqs"] = "required"
        kwargs["ssl_check_hostname"] = self.check_hostname
        if self.ca_file:
            kwargs["ssl_ca_certs"] = str(Path(self.ca_file).expanduser())
        if self.cert_file:
            kwargs["ssl_certfile"] = str(Path(self.cert_file).expanduser())
            kwargs["ssl_keyfile"] = str(Path(self.key_file).expanduser())
        return kwargs
