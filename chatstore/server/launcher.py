"""Run the app in a background thread on a loopback port (tests, benchmarks, notebooks).

with ServerThread(app) as server:
    httpx.get(server.url + "/healthz")
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from chatstore.api.common.app import create_app
from chatstore.api.common.settings import ServerSettings
from chatstore.model.loader import LoadedModel


class ServerThread:
    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, **uvicorn_kw: Any):
        kw = {"log_level": "warning", "access_log": False, "timeout_graceful_shutdown": 5}
        config = uvicorn.Config(app, host=host, port=port, **{**kw, **uvicorn_kw})
        self.app = app
        # uvicorn installs signal handlers only on the main thread: this one leaves them alone.
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="chatstore-api", daemon=True)
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the API server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def local_server(
    data_dir: str | Path,
    model: LoadedModel | None = None,
    settings: ServerSettings | None = None,
    **config_overrides: Any,
) -> ServerThread:
    """A real server (engine + store) on the default model, data under data_dir; not started.

    `model` (a LoadedModel) is reused when given, so several servers share one load."""
    from chatstore.config import load_config
    from chatstore.engine.runtime import create_runtime
    from chatstore.serving import build

    overrides = {"data_dir": str(data_dir), **config_overrides}
    engine_keys = {
        "max_running",
        "max_waiting",
        "max_tokens_per_step",
        "max_prefill_tokens_per_step",
        "finish_first_tokens",
        "admission_reserve_tokens",
    }
    engine_overrides = {k: overrides.pop(k) for k in list(overrides) if k in engine_keys}
    config = load_config(overrides=overrides, env={})
    for key, value in engine_overrides.items():  # engine limits Config may not carry
        object.__setattr__(config, key, value)
    runtime = create_runtime(config, model=model)
    serving = build(config, runtime=runtime)
    settings = settings or ServerSettings.from_config(config, env={})
    return ServerThread(create_app(serving, replace(settings, host="127.0.0.1")))
