"""The engine's set-up leaves no OpenMP pool on the caller's thread (engine/cpu/openmp_pools.py): libgomp
throttles every pool while there are more pool threads than CPUs, which slowed each forward of the
manager's thread by 30-50% on a 2-core machine."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.cpu.openmp_pools import on_scratch_thread

ROOT = Path(__file__).resolve().parents[2]


def test_runs_on_another_thread_and_returns_its_value() -> None:
    assert on_scratch_thread(lambda: threading.get_ident()) != threading.get_ident()


def test_reraises_the_exception_on_the_caller() -> None:
    def fail() -> None:
        raise ValueError("bad model")

    with pytest.raises(ValueError, match="bad model"):
        on_scratch_thread(fail)


# Counts the process's OS threads (libgomp's workers are invisible to `threading`) around the engine's
# set-up, then runs a parallel region on the same thread as a control: that one must add a pool.
PROBE = """
import os, time, torch
torch.set_num_threads(4)
from engine.engine import Engine
def threads():
    return len(os.listdir("/proc/self/task"))
before = threads()
engine = Engine.from_pretrained("smollm2-135m", load_format="dummy", device="cpu", dtype="float32",
                                num_blocks=64, max_num_seqs=4)
deadline = time.monotonic() + 10  # an ended thread's pool workers exit shortly after it
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.05)
after = threads()
torch.ones(1 << 24).mul_(2).sum()
print(before, after, threads())
"""


@pytest.mark.slow  # an engine set up in a fresh interpreter
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_engine_set_up_leaves_no_openmp_pool_on_the_calling_thread() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    before, after, control = map(int, done.stdout.split())
    assert after == before, f"set-up left {after - before} threads behind"
    assert control > after, "the control parallel region made no pool: the probe cannot see pools"
