"""Where a request's outputs go: a per-request queue (asyncio or plain), and the asyncio handle the
server iterates."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator
from typing import Protocol

from engine.outputs import GenerationOutput


class Cancellable(Protocol):
    def cancel_request(self, request_id: str) -> None: ...


class Sink(Protocol):
    def put(self, out: GenerationOutput) -> None: ...


class AsyncSink:
    """Hands outputs to an asyncio queue owned by the event loop that submitted the request."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[GenerationOutput] = asyncio.Queue()

    def put(self, out: GenerationOutput) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
        except RuntimeError:  # NOTE: the loop is closed: nobody is listening any more.
            pass


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
