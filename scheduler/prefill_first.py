"""Prefill first: finish started prompts before decoding."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.base import Scheduler
from scheduler.request import Request, RequestStatus


class PrefillFirstScheduler(Scheduler):
    """The unfinished chunks of split prefills (and recomputes) first, then decoding requests, then waiting
    requests in arrival order (in ``Scheduler.schedule``).

    Favours time-to-first-token of started requests; decodes may be starved for a step when long prompts
    take the whole token budget.
    """

    def order_running(self, running: Sequence[Request]) -> list[Request]:
        prefilling = [r for r in running if r.status is not RequestStatus.DECODING]
        decoding = [r for r in running if r.status is RequestStatus.DECODING]
        return prefilling + decoding
