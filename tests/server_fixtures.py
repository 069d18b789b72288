"""A real server for the HTTP tests: uvicorn on 127.0.0.1 (a free port) in a background thread, serving
the real default model (SmolLM2-135M-Instruct GGUF) on CPU, with an API key.

``start_live_server`` builds it; the ``live_server`` fixture (tests/conftest.py) starts it once per session
for every server and reliability test. Being in-process, tests can read ``live_server.state.manager.stats()``
(blocks freed, requests running). The SIGTERM drain is tested in a subprocess
(tests/server/test_server_lifecycle.py): signals reach only the main thread, so this server runs plain
``uvicorn.Server``. ``serve_in_thread`` serves any other app the same way (a test's own engine or config).
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

import uvicorn
from default_engine import engine_on

from engine.loader.model_loader import LoadedModel
from server.app import build_app
from server.config import ServerConfig
from server.lifecycle import ServerState, uvicorn_config

API_KEY = "test-key-123"
SERVED_NAME = "smollm2-test"
MAX_MODEL_LEN = 512
NUM_BLOCKS = 128  # x 16 = 2048 tokens: several requests at full context
MAX_BODY_BYTES = 256 * 1024
STARTUP_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str | None
    model: str
    state: ServerState

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

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


LIVE_CONFIG = ServerConfig(
    served_model_name=SERVED_NAME, api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES, shutdown_timeout=5.0
)


@contextmanager
def start_live_server(
    config: ServerConfig = LIVE_CONFIG,
    *,
    num_blocks: int = NUM_BLOCKS,
    max_model_len: int = MAX_MODEL_LEN,
    max_num_seqs: int = 16,
    logits_processors: tuple[str, ...] = (),
    loaded: LoadedModel | None = None,
    **engine_options: Any,
) -> Iterator[LiveServer]:
    """The default model on CPU behind the real app with ``config``, served until the block exits.

    The ``live_server`` fixture is the one with the defaults; a test that needs other limits (a tiny queue,
    fresh metrics, ``--logits-processors`` specs, ``Engine.from_pretrained`` options such as
    ``speculative_config``) starts its own with this. With ``loaded`` (the ``default_model`` fixture) its
    engine is a new one on that model (``engine_options``: ``CacheOptions``' fields only), else it loads
    the model itself."""
    from engine.engine import Engine

    limits: dict[str, Any] = dict(
        num_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=max_num_seqs
    )
    if loaded is not None:
        engine = engine_on(loaded, **limits, **engine_options)
    else:
        engine = Engine.from_pretrained(model="default", device="cpu", **limits, **engine_options)
    engine.load_logits_processors(logits_processors)
    app = build_app(engine, config)
    with serve_in_thread(app, f"{config.served_model_name}-uvicorn") as base_url:
        yield LiveServer(base_url, config.api_key, config.served_model_name, app.state.server)
