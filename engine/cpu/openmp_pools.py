"""Keep torch's OpenMP thread pools to one at a time: set-up work runs on a short-lived thread.

libgomp gives every thread that starts a parallel region its own pool of worker threads, kept for the
life of that thread. While the pools together hold more threads than the process has CPUs, libgomp
throttles all of them: a worker waiting for the next parallel region spins about 1,000 times instead of
300,000 and then sleeps, so each of the thousands of parallel regions in a forward pays for a wake-up.

The engine's forwards run on the manager's thread. If the thread that built the engine had run parallel
regions too (dequantizing and packing weights, zeroing the KV cache), its idle pool would be counted from
then on, and every decode step paid for the throttled wake-ups (measured: docs/benchmarks-log.md, commit
284f36d). ``on_scratch_thread`` runs the set-up on a thread that ends afterwards; libgomp frees a thread's
pool when the thread exits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_scratch_thread(fn: Callable[[], T], name: str = "cbserve-setup") -> T:
    """``fn()``, run on a new thread that is joined before returning; its exception is re-raised here."""
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # NOTE: handed to the caller's thread, whatever it is.
            error.append(exc)

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
