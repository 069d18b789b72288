"""The server's lifecycle: start the engine loop, admit requests, drain on SIGTERM, stop.

Draining (first SIGTERM/SIGINT, or ``ServerState.begin_drain()``): new generation requests get 503 and
/health turns 503, while requests already admitted run to completion. When none is left, or
``shutdown_timeout`` seconds have passed, uvicorn's own shutdown starts (close sockets, cancel what is
still running, run the lifespan's exit which stops the engine loop) and the process exits 0. A second
signal skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

from server.config import ServerConfig
from server.errors import APIError
from server.metrics import Metrics
from server.stats_logger import log_stats_forever

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.manager import ContinuousBatchingManager

logger = logging.getLogger(__name__)

ENGINE_STOP_TIMEOUT_S = 10.0


class ServerState:
    """What the routes share: the engine, its running manager, metrics, settings and the drain state.
    Lives on ``app.state.server``; touched only from the event loop thread (except ``begin_drain``, which
    a signal handler may call: it only sets plain attributes)."""

    def __init__(self, engine: Engine, config: ServerConfig, metrics: Metrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.manager: ContinuousBatchingManager | None = None
        self.created = int(time.time())
        self.draining = False
        self.drain_deadline: float | None = None
        self.num_active = 0  # admitted generation requests whose response is not finished

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (a 400 for a model loaded without one)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "the served model has no tokenizer", code="no_tokenizer")
        return tokenizer

    # ------------------------------------------------------------------ admission
    def running_manager(self) -> ContinuousBatchingManager:
        """The manager, if generation requests may be admitted now; else a 503."""
        if self.draining:
            raise APIError(
                503, "the server is shutting down and admits no new requests", code="server_draining"
            )
        if self.manager is None or not self.manager.is_running():
            raise APIError(503, "the engine loop is not running", code="engine_dead")
        return self.manager

    def is_healthy(self) -> bool:
        return not self.draining and self.manager is not None and self.manager.is_running()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count a request as in flight for the drain (around a non-streaming response)."""
        self.num_active += 1
        try:
            yield
        finally:
            self.num_active -= 1

    def acquire(self) -> ActiveRequest:
        """Count a request as in flight until the returned token is released (streaming responses,
        whose end is not the handler's return)."""
        self.num_active += 1
        return ActiveRequest(self)

    # ------------------------------------------------------------------ drain
    def begin_drain(self) -> None:
        if not self.draining:
            self.draining = True
            self.drain_deadline = time.monotonic() + self.config.shutdown_timeout

    def drain_done(self) -> bool:
        """True when draining and nothing is in flight any more, or the deadline passed."""
        if not self.draining:
            return False
        if self.num_active <= 0:
            return True
        return self.drain_deadline is not None and time.monotonic() >= self.drain_deadline

    # ------------------------------------------------------------------ start / stop
    def start(self) -> None:
        manager = self.engine.init_continuous_batching(
            max_queue=self.config.max_queue, grammar_timeout_s=self.config.grammar_compile_timeout
        )
        manager.add_step_observer(self.metrics.observe_step)
        manager.add_finish_observer(self.metrics.observe_finished)
        manager.start()
        self.manager = manager

    async def stop(self) -> None:
        manager, self.manager = self.manager, None
        if manager is not None:
            # NOTE: stop() joins the engine thread; off the event loop so that nothing else stalls.
            await asyncio.to_thread(manager.stop, True, ENGINE_STOP_TIMEOUT_S)


class ActiveRequest:
    """A release-once token of ``ServerState.acquire``."""

    def __init__(self, state: ServerState) -> None:
        self._state: ServerState | None = state

    def release(self) -> None:
        if self._state is not None:
            self._state.num_active -= 1
            self._state = None


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """FastAPI lifespan: the engine loop runs exactly while the app is served."""
    state: ServerState = app.state.server
    state.start()
    periodic_log = asyncio.create_task(
        log_stats_forever(lambda: state.manager.stats() if state.manager is not None else None)
    )
    try:
        yield
    finally:
        periodic_log.cancel()
        await state.stop()


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before its shutdown (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining:
            # NOTE: a second signal: stop waiting; uvicorn re-raises it after shutdown, as it would for
            # an impatient operator.
            super().handle_exit(sig, frame)
            return
        logger.info(
            "signal %d: draining %d in-flight request(s) for up to %.0f s",
            sig,
            self.state.num_active,
            self.state.config.shutdown_timeout,
        )
        self.state.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        if self.state.draining and not self.should_exit and self.state.drain_done():
            if self.state.num_active > 0:
                logger.warning("shutdown timeout reached with %d request(s) in flight", self.state.num_active)
            # NOTE: what is left after the drain (a finishing stream's last bytes) gets a short grace.
            self.config.timeout_graceful_shutdown = 2
            self.should_exit = True
        return await super().on_tick(counter)


def uvicorn_config(app: Any, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        lifespan="on",
        # NOTE: no access log at the default level: it is per request, and the metrics count requests.
        access_log=log_level.lower() == "debug",
        timeout_graceful_shutdown=2,
    )
