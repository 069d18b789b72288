"""engine/cpu/allocator.py in a fresh process (its settings are the process's): with ``keep_freed_memory``
freed blocks stay in the heap (the steps' temporaries are reused, not faulted in again), and
``release_freed_memory`` hands them back to the OS (what ``Engine.from_pretrained`` does once after loading)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
from engine.cpu.allocator import keep_freed_memory, release_freed_memory

def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

assert keep_freed_memory()
base = resident_mb()
blocks = [bytearray(1 << 20) for _ in range(256)]  # 256 MB in blocks under the mmap threshold, touched
loaded = resident_mb()
del blocks
kept = resident_mb()
assert release_freed_memory()
released = resident_mb()
print(base, loaded, kept, released)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_memory_is_kept_until_released() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    base, loaded, kept, released = (float(v) for v in done.stdout.split())
    assert loaded - base > 200  # the blocks were resident
    assert kept - base > 200  # freed, kept in the heap
    assert released - base < 50  # handed back
