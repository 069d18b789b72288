"""Fault injection for tests of the engine loop: wrap the manager's executor, the loop stays untouched."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from engine.loop import Executor
from engine.manager import ContinuousBatchingManager
from scheduler.batch import ScheduledBatch

Before = Callable[[ScheduledBatch], None]
Edit = Callable[[ScheduledBatch, torch.Tensor], torch.Tensor]


class FaultyExecutor:
    """Calls ``before(batch)`` ahead of each forward (it may raise, or block the engine thread), then the
    wrapped executor, then ``edit(batch, logits)`` (it may return changed logits, e.g. a NaN row)."""

    def __init__(self, inner: Executor, before: Before | None = None, edit: Edit | None = None) -> None:
        self.inner = inner
        self.before = before
        self.edit = edit

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        if self.before is not None:
            self.before(batch)
        logits = self.inner.execute(batch)
        if self.edit is not None:
            logits = self.edit(batch, logits)
        return logits

    def take_hidden_states(self) -> torch.Tensor:
        return self.inner.take_hidden_states()  # type: ignore[attr-defined]


@contextlib.contextmanager
def faulty_executor(
    manager: ContinuousBatchingManager, before: Before | None = None, edit: Edit | None = None
) -> Iterator[FaultyExecutor]:
    """``manager``'s executor wrapped in a ``FaultyExecutor`` for the duration of the block."""
    inner = manager.executor
    faulty = FaultyExecutor(inner, before, edit)
    manager.executor = faulty
    try:
        yield faulty
    finally:
        manager.executor = inner
