"""A real server for the HTTP tests: uvicorn on 127.0.0.1 (a free port) in a background thread, serving
the real default model (SmolLM2-135M-Instruct GGUF) on CPU, with an API key. Session-scoped: the model
loads once for every server test in the run.

Use it with ``live_server = server_fixtures.live_server`` in a test module and a ``live_server`` argument.
Each module that binds it gets its own fixture definition, so the server itself is a process-wide
singleton: the first use starts it, the rest share it, and it stops at the end of the session.
Being in-process, tests can read ``live_server.state.manager.stats()`` (blocks freed, requests running).
The SIGTERM drain is tested in a subprocess (tests/server/test_server_lifecycle.py): signals reach only the main
thread, so this server runs plain ``uvicorn.Server``.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn

from server.app import build_app
from server.config import ServerConfig
from server.lifecycle import ServerState, uvicorn_config

API_KEY = "test-key-123"
SERVED_NAME = "smollm2-test"
MAX_MODEL_LEN = 512
NUM_BLOCKS = 128  # x 16 = 2048 tokens: several requests at full context
MAX_BODY_BYTES = 256 * 1024
STARTUP_TIMEOUT_S = 180.0


@dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str
    model: str
    state: ServerState

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """True once the engine runs nothing and holds no KV blocks (bounded wait)."""
        return wait_until(lambda: _idle(self.state), timeout)


def _idle(state: ServerState) -> bool:
    manager = state.manager
    if manager is None:
        return False
    stats = manager.stats()
    return stats.num_requests_running == 0 and stats.num_requests_waiting == 0 and stats.kv_cache_usage == 0.0


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_in_thread(app: Any, name: str) -> Iterator[str]:
    """Run ``app`` with uvicorn on 127.0.0.1 (a free port) in a daemon thread; yields its base URL and
    stops it on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), name=name, daemon=True)
    thread.start()
    if not wait_until(lambda: server.started or not thread.is_alive(), STARTUP_TIMEOUT_S):
        raise RuntimeError(f"the {name} server did not start in time")
    if not server.started:
        raise RuntimeError(f"the {name} server failed to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


_shared: LiveServer | None = None


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    global _shared
    if _shared is not None:
        yield _shared
        return
    from engine.engine import Engine

    engine = Engine.from_pretrained(
        model="default", device="cpu", num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, max_num_seqs=16
    )
    config = ServerConfig(
        served_model_name=SERVED_NAME, api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES, shutdown_timeout=5.0
    )
    app = build_app(engine, config)
    with serve_in_thread(app, "test-uvicorn") as base_url:
        _shared = LiveServer(base_url, API_KEY, SERVED_NAME, app.state.server)
        try:
            yield _shared
        finally:
            _shared = None
