"""The engine thread's inbox: typed messages from the callers' threads, and the event that wakes the loop.

Callers ``put`` from any thread; only the engine thread ``drain``s. ``num_adds`` counts the requests put
but not yet drained, so that admission can bound the waiting queue before the engine has seen them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.sequence_group import SequenceGroup


@dataclass(frozen=True)
class AddRequest:
    group: SequenceGroup


@dataclass(frozen=True)
class CancelRequest:
    request_id: str


@dataclass(frozen=True)
class EvictRequest:
    """Drop a finished request's blocks from the prefix cache."""

    request_id: str


@dataclass(frozen=True)
class ResetPrefixCache:
    """Empty the prefix cache; ``done`` gets True, or False while requests hold blocks."""

    done: Future[bool] = field(default_factory=Future)


InboxMessage = AddRequest | CancelRequest | EvictRequest | ResetPrefixCache


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()
        self._num_adds = 0

    @property
    def num_adds(self) -> int:
        """Requests put and not yet drained."""
        with self._lock:
            return self._num_adds

    def put(self, message: InboxMessage) -> None:
        if isinstance(message, AddRequest):
            with self._lock:
                self._num_adds += 1
        self._queue.put(message)
        self._wakeup.set()

    def drain(self) -> Iterator[InboxMessage]:
        """Every message put so far, in order (engine thread only)."""
        while True:
            try:
                message = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, AddRequest):
                with self._lock:
                    self._num_adds -= 1
            yield message

    def wake(self) -> None:
        self._wakeup.set()

    def wait(self, timeout: float) -> None:
        """Sleep until a message arrives, ``wake`` is called, or ``timeout`` seconds pass."""
        self._wakeup.wait(timeout=timeout)
        self._wakeup.clear()
