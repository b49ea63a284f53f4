"""What a web browser may ask of the server: the Host check, CORS and the JSON content type.

A page on any site can make the user's browser talk to a server on loopback in ways that no API
key stops when there is none (local mode), and that a key alone does not make harmless:

* DNS rebinding: the page's own name is made to resolve to 127.0.0.1, so the browser treats the
  server as same-origin and sends `Host: evil.example`. In local mode only loopback names, the
  bound host and `allowed_hosts` are accepted (with keys set, the keys protect).
* "Simple" cross-origin requests (a form POST, a no-cors fetch) go out without a preflight. A
  POST/PUT/PATCH must be `Content-Type: application/json`, which a browser never sends
  cross-origin without a preflight, and a state-changing request whose Origin is neither the
  server's own nor in `cors_origins` is refused outright.
* Browsers apply no CORS to WebSockets, so an upgrade from a foreign Origin is refused
  (cross-site WebSocket hijacking).

Clients that are not browsers send no Origin header and are unaffected by the last two checks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlsplit

from starlette.types import Scope

from chatstore.api.common.errors import APIError
from chatstore.api.common.settings import ServerSettings, is_loopback

JSON_METHODS = frozenset({"POST", "PUT", "PATCH"})
STATE_CHANGING = JSON_METHODS | {"DELETE"}
ALLOW_METHODS = b"GET, POST, PUT, PATCH, DELETE, OPTIONS"
ALLOW_HEADERS = b"Authorization, Content-Type, X-Session-ID"
EXPOSE_HEADERS = b"Retry-After, X-Session-ID"
PREFLIGHT_MAX_AGE = b"600"
DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}

Headers = list[tuple[bytes, bytes]]


class Incoming(NamedTuple):
    """The parts of a request (or WebSocket upgrade) the policy looks at."""

    method: str  # "WEBSOCKET" for an upgrade
    host: str | None
    origin: str | None
    content_type: str | None
    preflight_headers: str | None  # Access-Control-Request-Headers
    is_preflight: bool

    @classmethod
    def from_scope(cls, scope: Scope) -> Incoming:
        found: dict[bytes, str] = {}
        for name, value in scope.get("headers", ()):
            found.setdefault(name, value.decode("latin-1"))
        method = scope["method"] if scope["type"] == "http" else "WEBSOCKET"
        preflight = method == "OPTIONS" and b"access-control-request-method" in found
        return cls(
            method=method,
            host=found.get(b"host"),
            origin=found.get(b"origin"),
            content_type=found.get(b"content-type"),
            preflight_headers=found.get(b"access-control-request-headers"),
            is_preflight=preflight and b"origin" in found,
        )


@dataclass(frozen=True)
class OriginPolicy:
    check_host: bool  # local mode: no key protects against DNS rebinding
    hosts: frozenset[str]  # accepted besides loopback names: bound host, allowed_hosts
    any_origin: bool
    origins: frozenset[str]  # normalised "scheme://host[:port]"

    def refusal(self, req: Incoming) -> APIError | None:
        if self.check_host and not self.host_allowed(req.host):
            return APIError(
                403,
                f"Host {req.host!r} is not allowed: without API keys the server answers only to "
                "loopback names; add the name to allowed_hosts (CHATSTORE_ALLOWED_HOSTS)",
                code="host_not_allowed",
            )
        guarded = req.is_preflight or req.method in STATE_CHANGING or req.method == "WEBSOCKET"
        if guarded and req.origin is not None and not self.trusts(req.origin, req.host):
            return APIError(
                403,
                f"cross-origin request from {req.origin[:200]!r} refused; allow the origin "
                "with cors_origins (CHATSTORE_CORS_ORIGINS)",
                code="origin_not_allowed",
            )
        if req.method in JSON_METHODS and not is_json(req.content_type):
            return APIError(
                415,
                f"{req.method} needs 'Content-Type: application/json' (got "
                f"{(req.content_type or 'none')[:100]!r}); send {{}} when there is no body",
                code="unsupported_media_type",
            )
        return None

    def host_allowed(self, host: str | None) -> bool:
        # A browser always sends Host, so a request without one is no rebinding attack.
        if host is None:
            return True
        name = host_name(host)
        return name in self.hosts or is_loopback(name)

    def trusts(self, origin: str, host: str | None) -> bool:
        return self.cors_allowed(origin) or same_origin(origin, host)

    def cors_allowed(self, origin: str) -> bool:
        return self.any_origin or normal_origin(origin) in self.origins

    def cors_headers(self, req: Incoming) -> Headers:
        """Headers that let a browser page on an allowed origin read the response."""
        if req.origin is None or not self.cors_allowed(req.origin):
            return []
        if self.any_origin:
            return [(b"access-control-allow-origin", b"*"), *_expose()]
        origin = req.origin.encode("latin-1")
        return [(b"access-control-allow-origin", origin), (b"vary", b"Origin"), *_expose()]

    def preflight_headers(self, req: Incoming) -> Headers:
        """What an allowed preflight adds to `cors_headers`."""
        # Echo the asked-for headers: the page is trusted, and the official JS clients add
        # their own (x-stainless-*) besides Authorization and Content-Type.
        asked = req.preflight_headers.encode("latin-1") if req.preflight_headers else ALLOW_HEADERS
        return [
            (b"access-control-allow-methods", ALLOW_METHODS),
            (b"access-control-allow-headers", asked),
            (b"access-control-max-age", PREFLIGHT_MAX_AGE),
        ]


def policy_for(settings: ServerSettings) -> OriginPolicy:
    return _build(settings.local_mode, settings.host, settings.allowed_hosts, settings.cors_origins)


@functools.lru_cache(maxsize=16)
def _build(local_mode: bool, bound: str, allowed_hosts: str, cors_origins: str) -> OriginPolicy:
    hosts = {host_name(h) for h in _items(allowed_hosts)} | {host_name(bound)}
    origins = _items(cors_origins)
    return OriginPolicy(
        check_host=local_mode,
        hosts=frozenset(hosts),
        any_origin="*" in origins,
        origins=frozenset(normal_origin(o) for o in origins if o != "*"),
    )


def is_json(content_type: str | None) -> bool:
    """application/json, with any parameters (charset)."""
    if content_type is None:
        return False
    return content_type.partition(";")[0].strip().lower() == "application/json"


def host_name(host: str) -> str:
    """'Localhost:8000' -> 'localhost', '[::1]:8000' -> '::1' (also a bare '::1')."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") > 1:
        return host
    return host.partition(":")[0].rstrip(".")


def same_origin(origin: str, host: str | None) -> bool:
    """Does the Origin name this server as the browser reached it (the Host header)?

    A Host without a port takes the origin scheme's default, so a TLS-terminating proxy in front
    (origin https, Host without port, plain http here) still counts as same-origin."""
    parts = _split_origin(origin)
    if parts is None or host is None:
        return False
    scheme, name, port = parts
    host_port = _host_port(host)
    return name == host_name(host) and port == (host_port or DEFAULT_PORTS.get(scheme))


def normal_origin(origin: str) -> str:
    parts = _split_origin(origin)
    if parts is None:
        return origin.strip().lower()
    scheme, name, port = parts
    shown = f"[{name}]" if ":" in name else name
    return (
        f"{scheme}://{shown}" if port == DEFAULT_PORTS.get(scheme) else f"{scheme}://{shown}:{port}"
    )


def _split_origin(origin: str) -> tuple[str, str, int | None] | None:
    try:
        url = urlsplit(origin.strip().rstrip("/"))
        port = url.port
    except ValueError:
        return None
    if not url.scheme or not url.hostname:
        return None  # "null" (sandboxed frames, file://) is nobody's origin
    scheme = url.scheme.lower()
    return scheme, url.hostname.rstrip("."), port or DEFAULT_PORTS.get(scheme)


def _host_port(host: str) -> int | None:
    tail = host.rpartition("]")[2] if host.startswith("[") else host
    if host.count(":") > 1 and not host.startswith("["):
        return None
    _, sep, port = tail.partition(":")
    return int(port) if sep and port.isdigit() else None


def _items(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


def _expose() -> Headers:
    return [(b"access-control-expose-headers", EXPOSE_HEADERS)]
