"""The API server inside this process, on a free loopback port (`chatstore chat --local`).

Built as `chatstore serve` builds it: settings from the Config and CHATSTORE_*, `build_app`
(the backend in a short-lived thread so the engine thread owns the OpenMP pool), uvicorn with
`uvicorn_config`'s options. Only the bind differs: 127.0.0.1, a port the kernel picks, uvicorn in
a background thread while the main thread runs the chat.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace

from chatstore.api.common.settings import ServerSettings
from chatstore.config import Config
from chatstore.server.launcher import ServerThread
from chatstore.server.run import SWITCH_INTERVAL_S, build_app, install_log_redaction

START_TIMEOUT_S = 300.0  # a first run converts the embedded model


def start_in_process(config: Config, log_level: str = "warning") -> ServerThread:
    """A started server on 127.0.0.1:<free port>; stop() drains it and flushes the store."""
    settings = ServerSettings.from_config(config)
    settings = replace(settings, host="127.0.0.1", port=0, log_level=log_level)
    _quiet_logging(log_level)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = build_app(config, settings)
    server = ServerThread(  # uvicorn_config's options, on a port of the kernel's choosing
        app,
        host=settings.host,
        port=0,
        log_level=log_level,
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
        ws_ping_interval=20.0,
        ws_max_size=settings.max_body_bytes,
    )
    return server.start(timeout=START_TIMEOUT_S)


def _quiet_logging(level: str) -> None:
    """The server shares the terminal with the chat: records at `level` and above only, on
    stderr, with keys redacted as `chatstore serve` does."""
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s %(message)s"
    )
    logging.getLogger().setLevel(level.upper())
    install_log_redaction()
