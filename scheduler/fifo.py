"""First come, first served, decodes first: the default policy."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.base import Scheduler
from scheduler.request import Request, RequestStatus


class FIFOScheduler(Scheduler):
    """Decoding requests first (one token each: they keep streaming at a steady pace), then the remaining
    chunks of split prefills, then waiting requests in arrival order (in ``Scheduler.schedule``).

    Favours inter-token latency of running requests over time-to-first-token of new ones.
    """

    def order_running(self, running: Sequence[Request]) -> list[Request]:
        decoding = [r for r in running if r.status is RequestStatus.DECODING]
        rest = [r for r in running if r.status is not RequestStatus.DECODING]
        return decoding + rest
