"""Which requests run each step, under which budgets. Pure Python (no torch); the KV blocks are kvcache/'s."""

from scheduler.base import Scheduler
from scheduler.batch import ScheduledBatch, ScheduledRequest
from scheduler.config import SchedulerConfig
from scheduler.errors import RequestTooLargeError
from scheduler.fifo import FIFOScheduler
from scheduler.prefill_first import PrefillFirstScheduler
from scheduler.request import FinishReason, Request, RequestStatus

SCHEDULERS: dict[str, type[Scheduler]] = {"fifo": FIFOScheduler, "prefill_first": PrefillFirstScheduler}


def make_scheduler(name: str, config: SchedulerConfig) -> Scheduler:
    """The scheduler policy called ``name`` ("fifo" or "prefill_first")."""
    cls = SCHEDULERS.get(name)
    if cls is None:
        raise ValueError(f"unknown scheduler policy {name!r}; choose one of {sorted(SCHEDULERS)}")
    return cls(config)


__all__ = [
    "SCHEDULERS",
    "FIFOScheduler",
    "FinishReason",
    "PrefillFirstScheduler",
    "Request",
    "RequestStatus",
    "RequestTooLargeError",
    "ScheduledBatch",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "make_scheduler",
]
