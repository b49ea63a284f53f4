"""The browser pages: the chat at `/`, the cache dashboard at `/admin/ui`, their files under
`/static/`, and (history_routes.py, beside it) the dashboard's time series at `/admin/history`.

The pages hold no secret and are served without a key; what they show comes from the API with
the key the user types in (kept by the browser). Every file ships in the package (no build step,
nothing fetched from elsewhere), so the policy below can forbid any other origin: scripts, styles,
images and connections (fetch and the session WebSocket) are the server's own, inline script and
style are refused, and no other site may frame the pages.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response

from chatstore.api.common.errors import APIError

STATIC_DIR = Path(__file__).parent / "static"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # a typed key must never leak through a link
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",  # revalidate (ETag), so an upgraded server serves new files
}


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    media_type: str
    etag: str


def load_static(directory: Path = STATIC_DIR) -> dict[str, StaticFile]:
    """Every servable file, read once: a request can only name one of these (no path walks)."""
    files: dict[str, StaticFile] = {}
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        media_type = MEDIA_TYPES.get(path.suffix)
        if path.is_file() and media_type is not None:
            body = path.read_bytes()
            etag = '"' + hashlib.blake2b(body, digest_size=8).hexdigest() + '"'
            files[path.name] = StaticFile(body, media_type, etag)
    return files


FILES = load_static()
router = APIRouter()


def serve(name: str, request: Request) -> Response:
    file = FILES.get(name)
    if file is None:
        raise APIError(404, f"no static file {name[:64]!r}", code="not_found")
    headers = {**SECURITY_HEADERS, "ETag": file.etag}
    if request.headers.get("if-none-match") == file.etag:
        return Response(status_code=304, headers=headers)
    return Response(file.body, media_type=file.media_type, headers=headers)


@router.get("/", include_in_schema=False)
def chat_page(request: Request) -> Response:
    return serve("chat.html", request)


@router.get("/admin/ui", include_in_schema=False)
def dashboard_page(request: Request) -> Response:
    return serve("dashboard.html", request)


@router.get("/static/{name}", include_in_schema=False)
def static_file(name: str, request: Request) -> Response:
    return serve(name, request)
