"""Where a request's outputs go: a per-request queue (asyncio or plain), and the asyncio handle the
server iterates.

The engine thread ``put``s each output on its request's sink as a step publishes it and ``flush``es the
sinks once the step is done. An asyncio sink's outputs wait in its event loop's ``LoopMailbox`` until
then and cross over in one wake-up of the loop for the whole step: a wake-up per output costs the engine
thread a GIL hand-over and a context switch to the loop's thread and back, per output (measured:
docs/benchmarks-log.md).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import AsyncIterator
from typing import Protocol

from engine.outputs import GenerationOutput


class Cancellable(Protocol):
    def cancel_request(self, request_id: str) -> None: ...


class Sink(Protocol):
    def put(self, out: GenerationOutput) -> None: ...

    def flush(self) -> None:
        """Deliver what ``put`` has held back, if anything."""


class LoopMailbox:
    """The outputs bound for one event loop's queues, in the order they were put; ``flush`` hands them
    all over in one callback on the loop (at most one is pending at a time)."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()
    _registry_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[GenerationOutput], GenerationOutput]] = []
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        with cls._registry_lock:
            mailbox = cls._by_loop.get(loop)
            if mailbox is None:
                mailbox = cls._by_loop[loop] = cls(loop)
            return mailbox

    def add(self, target: asyncio.Queue[GenerationOutput], out: GenerationOutput) -> None:
        with self._lock:
            self._items.append((target, out))

    def flush(self) -> None:
        with self._lock:
            if self._scheduled or not self._items:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # NOTE: the loop is closed: nobody is listening any more.
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _deliver(self) -> None:  # on the loop's thread
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for target, out in items:
            target.put_nowait(out)


class AsyncSink:
    """Hands outputs to an asyncio queue owned by the event loop that submitted the request, through that
    loop's mailbox (delivered when the engine thread flushes)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[GenerationOutput] = asyncio.Queue()
        self.mailbox = LoopMailbox.of(loop)

    def put(self, out: GenerationOutput) -> None:
        self.mailbox.add(self.queue, out)

    def flush(self) -> None:
        self.mailbox.flush()


class SyncSink:
    """Hands outputs to a per-request queue and announces the request id on the manager's ready queue."""

    def __init__(self, request_id: str, ready: queue.Queue[str], n: int = 1) -> None:
        self.request_id = request_id
        self.ready = ready
        self.queue: queue.Queue[GenerationOutput] = queue.Queue()
        self.unread_finals = n  # final outputs not yet read: the sink is dropped when it reaches 0

    def put(self, out: GenerationOutput) -> None:
        self.queue.put(out)
        self.ready.put(self.request_id)

    def flush(self) -> None:
        pass  # put has delivered already


class RequestHandle:
    """The asyncio face of one request: ``async for out in handle`` yields its outputs (all samples,
    interleaved, ``out.index`` telling which) and ends when every sample has finished. Leaving the loop
    early, or cancelling the task that iterates, cancels the request."""

    def __init__(self, manager: Cancellable, request_id: str, n: int, sink: AsyncSink) -> None:
        self._manager = manager
        self.request_id = request_id
        self.n = n
        self._sink = sink
        self._remaining = n

    def __aiter__(self) -> AsyncIterator[GenerationOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[GenerationOutput]:
        try:
            while self._remaining:
                out = await self._sink.queue.get()
                if out.is_finished:
                    self._remaining -= 1
                yield out
        finally:
            if self._remaining:
                self.cancel()

    @property
    def finished(self) -> bool:
        return self._remaining == 0

    def cancel(self) -> None:
        self._manager.cancel_request(self.request_id)
