"""``one_torch_thread()``: torch's intra-op pool at one thread for a block; for the transformers oracle's
forwards and ``generate`` calls on the test's own thread (never while an engine of the test runs: the
setting is the process's).

A transformers forward of the default model is thousands of small parallel regions (a matmul of a few rows
each). On a 2-core machine that another process loads, every region waits at libgomp's barrier for a worker
the kernel has descheduled: the 6 batched beam searches of tests/engine/test_beam_search_default_model.py
took 157 s on two threads against 11 s on one, with the same beams (scores within 2e-6). On an idle
machine both take the same time: a step reads every weight, whatever the threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
