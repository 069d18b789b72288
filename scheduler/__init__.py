"""Which requests run each step, and their KV block tables. Pure Python (no torch)."""

from scheduler.base import Scheduler
from scheduler.batch import ScheduledBatch, ScheduledRequest
from scheduler.config import SchedulerConfig
from scheduler.errors import IntegrityError, RequestTooLargeError
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
    "IntegrityError",
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
