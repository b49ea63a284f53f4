"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Every failure the API reports goes through `APIError`; the handlers installed by
`install_error_handlers` also turn FastAPI's validation errors, malformed JSON and unexpected
exceptions into that shape, so a client never sees an HTML page or a bare 500 traceback.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("chatstore.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    507: "insufficient_storage_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def not_found(what: str) -> APIError:
    return APIError(404, f"{what} not found", code="not_found")


def bad_param(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def store_error(exc: Exception) -> APIError:
    """A session record that could not be read or written durably: 507 when the records
    store is full (nothing more fits until sessions are deleted), 503 when it is unreachable,
    409 when another replica wrote the session since this turn read it."""
    from chatstore.store.ports import RecordConflict, RecordStoreFull

    if isinstance(exc, RecordStoreFull):
        return APIError(507, f"session store is full: {exc}", code="store_full")
    if isinstance(exc, RecordConflict):
        message = "the session changed on another replica; retry"
        return APIError(409, f"{message} ({exc})", code="session_conflict")
    retry = {"Retry-After": "1"}
    message = f"session store unavailable: {exc}"
    return APIError(503, message, code="store_unavailable", headers=retry)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first validation problem, naming its field as a dotted path ('messages.0.content')."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind in ("json_invalid", "json_type"):
        return APIError(400, "request body is not valid JSON", code="invalid_json")
    if kind == "missing" and not loc:
        return APIError(400, "request body is missing", code="invalid_json")
    message = str(first.get("msg", "invalid request"))
    return APIError(400, f"{param}: {message}" if param else message, param=param, code=kind)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(exc))


async def _http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    err = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    return error_response(err)


async def _store(_: Request, exc: Exception) -> JSONResponse:
    return error_response(store_error(exc))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(APIError(500, "internal server error", code="internal_error"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    from chatstore.store.ports import RecordStoreError

    app.add_exception_handler(RecordStoreError, _store)
    app.add_exception_handler(Exception, _unexpected)


# The error responses every route documents in the OpenAPI schema.
ERRORS: dict[int | str, dict[str, object]] = {
    400: {"description": "invalid request"},
    401: {"description": "missing or invalid API key"},
    404: {"description": "unknown session"},
    429: {"description": "queue full (Retry-After)"},
    503: {"description": "draining"},
}
