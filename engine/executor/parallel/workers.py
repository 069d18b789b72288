"""Rank 0's handle on ranks 1..N-1 of a tensor-parallel model: their processes, the messages sent to them,
and whether they all live.

A rank whose process exits (killed, crashed) is seen at once by a watchdog thread; a message that cannot
be sent, or a step whose collectives fail or time out (engine/executor/parallel/runner.py), marks the
group failed too. From then on ``check_alive`` raises ``ExecutorFailedError``: the ranks are out of step,
and no step can run again in this process. While rank 0 sends nothing, a heartbeat goes out every
``HEARTBEAT_S`` so that the other ranks, which wait for a message at most ``IDLE_TIMEOUT_S``, know it lives.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from engine.errors import ExecutorFailedError
from engine.executor.parallel.group import ShardGroup
from engine.executor.parallel.messages import AllocateCache, Heartbeat, Message, Stop

logger = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
IDLE_TIMEOUT_S = 30 * HEARTBEAT_S
STOP_TIMEOUT_S = 10.0


class ShardWorkers:
    """Ranks 1..N-1 (``processes[i]`` is rank ``i + 1`` where the loader spawned them), connected by the
    loader. Under torchrun this process sees no other rank's process: a rank that dies is seen by the
    collective that fails (gloo: at once, its connection closed; else after the timeout), and torchrun
    itself stops the others."""

    def __init__(self, group: ShardGroup, processes: list[BaseProcess], local_world_size: int) -> None:
        self.group = group
        self.processes = processes  # none under torchrun: each rank is a process torchrun started
        self.local_world_size = local_world_size  # the ranks on rank 0's machine (its share of the cores)
        self.failure: str | None = None
        self.cache_shape: AllocateCache | None = None  # what the ranks' KV caches are now
        self._lock = threading.Lock()  # NOTE: one message at a time: the engine thread's and the heartbeat's
        self._last_send = time.monotonic()
        self._closing = threading.Event()
        for target, name in ((self._watch, "watchdog"), (self._beat, "heartbeat")):
            threading.Thread(target=target, name=f"cbserve-tp-{name}", daemon=True).start()
        # NOTE: before multiprocessing's own exit handler (registered earlier, run later) kills the ranks
        atexit.register(self.close)

    def send(self, message: Message) -> None:
        """Broadcast ``message`` to the other ranks; ``ExecutorFailedError`` once they cannot hear it."""
        with self._lock:
            self.check_alive()
            try:
                self.group.send(message)
            except RuntimeError as exc:
                # NOTE: the send often sees the closed connection before the watchdog sees the exit
                exited = self._exited(timeout=0.5)
                reason = f"rank 0 could not reach the other ranks: {exc}"
                raise self.fail(f"{exited}: {reason}" if exited else reason) from exc
            self._last_send = time.monotonic()

    def allocate_cache(self, shape: AllocateCache) -> None:
        """Size the other ranks' KV caches as rank 0's (once per shape)."""
        if shape != self.cache_shape:
            self.send(shape)
            self.cache_shape = shape

    def check_alive(self) -> None:
        if self.failure is not None:
            raise ExecutorFailedError(self.failure)

    def fail(self, reason: str) -> ExecutorFailedError:
        """Mark the group failed (the first reason stays) and return the error to raise."""
        if self.failure is None:
            self.failure = f"tensor parallelism failed: {reason}"
            logger.error("%s", self.failure)
        return ExecutorFailedError(self.failure)

    def step_failed(self, exc: BaseException) -> ExecutorFailedError:
        """Mark the group failed by a step that raised ``exc``, naming the rank whose process exited where
        one did (a collective often sees the closed connection before the watchdog sees the exit)."""
        exited = self._exited(timeout=0.5)
        if exited is not None:
            return self.fail(f"{exited}: {exc!r}")
        return self.fail(f"a step failed: {exc!r}")

    def close(self) -> None:
        """Stop the other ranks (a ``Stop`` message, then SIGTERM to any still running)."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self.failure is None:
            try:
                self.send(Stop())
            except ExecutorFailedError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(STOP_TIMEOUT_S)

    # ------------------------------------------------------------------ threads
    def _exited(self, timeout: float) -> str | None:
        """Which rank's process has exited (waiting up to ``timeout``), or None.
        NOTE: by its sentinel, never by reaping it: two threads reaping race, and the loser sees it alive."""
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, start=1)}
        ended = wait(list(sentinels), timeout=timeout)
        if not ended:
            return None
        rank = sentinels[ended[0]]  # type: ignore[index]
        return f"rank {rank}'s process exited"

    def _watch(self) -> None:
        while not self._closing.is_set():
            exited = self._exited(timeout=1.0)
            if exited is not None and not self._closing.is_set():
                self.fail(exited)
                return

    def _beat(self) -> None:
        while not self._closing.wait(HEARTBEAT_S / 4):
            if self.failure is not None:
                return
            if time.monotonic() - self._last_send >= HEARTBEAT_S:
                try:
                    self.send(Heartbeat())
                except ExecutorFailedError:
                    return
