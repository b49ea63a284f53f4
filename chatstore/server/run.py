"""`chatstore serve`: uvicorn over the app, with a graceful drain on SIGINT/SIGTERM.

On a signal the server stops accepting work (new turns get 503 + Retry-After, /readyz turns 503),
lets in-flight turns finish for `drain_timeout_s`, aborts the rest (freeing their blocks), then
the app's lifespan stops the engine and closes the store (DRAM sessions flushed to LMDB).
"""

from __future__ import annotations

import logging
import re
import sys
from types import FrameType

import torch
import uvicorn
from fastapi import FastAPI

from chatstore.api.chat.service import ChatService
from chatstore.api.common.app import create_app
from chatstore.api.common.settings import ServerSettings, forget_plain_keys
from chatstore.config import Config

log = logging.getLogger("chatstore.api")
SWITCH_INTERVAL_S = 0.001  # GIL hand-over between the engine thread and the event loop


class DrainingServer(uvicorn.Server):
    """A uvicorn server that marks the service as draining as soon as it is told to exit."""

    def __init__(self, config: uvicorn.Config, service: ChatService) -> None:
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.service.draining = True
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after its shutdown; a completed drain exits with 0.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


# uvicorn logs a WebSocket's path with its query string ('"WebSocket /v1/...?api_key=..."
# [accepted]') and, at debug level, the handshake's headers; both carry keys. Every uvicorn
# protocol logs through these two loggers (the websockets library too, given uvicorn.error).
SECRETS = re.compile(r"(api_key=)[^&\s\"']+|(authorization:\s*\w+\s+)\S+", re.IGNORECASE)
REDACTED_LOGGERS = ("uvicorn.error", "uvicorn.access", "chatstore.access")


class RedactSecrets(logging.Filter):
    """Replaces API keys in a record's message with '***' (the record is kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: let logging report it as it would
            return True
        redacted = SECRETS.sub(lambda m: (m.group(1) or m.group(2)) + "***", message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


def install_log_redaction() -> None:
    """Filters on the loggers themselves: uvicorn's dictConfig replaces handlers, not filters
    (a logger's filter sees only records logged on it, hence the exact names)."""
    for name in REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    install_log_redaction()


def uvicorn_config(app: FastAPI, settings: ServerSettings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,  # the API logs one structured line per request itself
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
        ws_ping_interval=20.0,
        ws_max_size=settings.max_body_bytes,  # a frame is a request body: the same cap
    )


def build_app(config: Config, settings: ServerSettings) -> FastAPI:
    """The app over a new Serving (chatstore.serving.build), built in a short-lived thread so
    that the engine thread alone owns an OpenMP pool (see cpu_threads.py); `chatstore chat
    --local` builds it the same way."""
    from chatstore.cpu_priority import describe_background_class
    from chatstore.cpu_threads import in_temporary_thread, leave_cores_to_engine
    from chatstore.serving import build

    cores = torch.get_num_threads()
    serving = in_temporary_thread(build, config)
    if serving.engine.device_type == "cpu":
        serving.engine.compute_threads = cores
        leave_cores_to_engine()
        log.info("chatstore: %s", describe_background_class())
    return create_app(serving, settings)


def run_server(config: Config) -> int:
    """Serve until interrupted; the exit code (0 after a clean drain)."""
    try:
        settings = ServerSettings.from_config(config)
        settings.check_bind()
        config = forget_plain_keys(config)  # hashed in settings; not kept in the clear
    except ValueError as exc:
        print(f"chatstore: error: {exc}", file=sys.stderr)
        return 2
    # The engine thread holds the GIL between torch ops; a shorter switch interval lets the
    # event loop take requests and deliver tokens without waiting the default 5 ms each time.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    configure_logging(settings.log_level)
    app = build_app(config, settings)
    server = DrainingServer(uvicorn_config(app, settings), app.state.service)
    mode = "local single-user mode" if settings.local_mode else "API keys (hashed)"
    log.info("chatstore: serving on http://%s:%d (%s)", settings.host, settings.port, mode)
    server.run()
    return 0 if server.started else 1
