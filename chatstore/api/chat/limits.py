"""The limits a request's text and fields are checked against before a turn or a session is
opened: 400s that name the field as the calling API names it."""

from __future__ import annotations

import json
from typing import Any

from chatstore.api.common.errors import bad_param
from chatstore.store.retention import RetentionError, check_retention


def check_text(param: str, text: str, max_chars: int) -> str:
    """A message's text within the service's limits (length, valid Unicode), or a 400 naming
    `param` as the calling API names it."""
    if len(text) > max_chars:
        raise bad_param(
            param, f"message is {len(text)} characters; the limit is {max_chars}", "too_long"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800"): JSON allows it
        raise bad_param(
            param, f"text is not valid Unicode at character {exc.start}", "invalid_text"
        ) from None
    return text


def check_metadata(metadata: dict[str, str], limit: int) -> None:
    size = len(json.dumps(metadata))
    if size > limit:
        raise bad_param(
            "metadata", f"metadata is {size} bytes as JSON; the limit is {limit}", "too_long"
        )


def check_retention_fields(fields: dict[str, Any]) -> None:
    """priority and ttl_s: the schema bounds them already; this guards callers that bypass it."""
    try:
        check_retention(fields.get("priority"), fields.get("ttl_s"))
    except RetentionError as exc:
        raise bad_param(exc.field, str(exc)) from None
