"""Building cbserve's C kernels: the system C compiler, on first use, cached on disk, loaded with ``ctypes``.

Why ``cc`` + ``ctypes`` and not a torch C++ extension: the kernels are plain C (no torch headers), so each
compiles in well under a second; they are built with ``-march=native`` for the machine they run on, and
the shared objects are cached under ``$XDG_CACHE_HOME/cbserve/kernels`` keyed by the source, the flags,
the compiler and the CPU, so a different machine or a changed source never loads a stale build. ``ctypes``
releases the GIL during a call.

OpenMP in the kernels: the libraries ask for libgomp.so.1, which resolves to the copy torch has already
loaded, so torch and the kernels share one thread pool (``torch.set_num_threads`` applies to both).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

# -ffast-math lets the compiler reassociate the sums into SIMD lanes and call libmvec's vectorised expf.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
# NOTE: linked in a second step WITHOUT -ffast-math: linking with it adds crtfastmath.o, whose constructor
# sets flush-to-zero and denormals-are-zero in the CPU's control register for the whole process -- every
# float op of torch, numpy and Python itself would change (hypothesis's float strategies refuse to run).
LINK_FLAGS = ["-shared", "-fopenmp"]
LIBS = ["-lm"]  # libmvec (the vectorised expf) comes with libm


class KernelUnavailable(RuntimeError):
    """A C kernel cannot be used here (no C compiler, a failed build, an unsupported shape)."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelUnavailable("no C compiler (cc or gcc) on PATH; install gcc or set CC")
    return cc


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(wanted))) or os.uname().machine


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "cbserve" / "kernels"


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _sources(source_path: Path, seen: set[Path] | None = None) -> list[bytes]:
    """The source and, recursively, every file it includes with ``#include "..."`` (relative to it): all
    go into the cache key, so a change in an included kernel rebuilds its includer."""
    seen = set() if seen is None else seen
    path = source_path.resolve()
    if path in seen:
        return []
    seen.add(path)
    text = path.read_bytes()
    parts = [text]
    for name in _LOCAL_INCLUDE.findall(text):
        included = path.parent / name.decode()
        if included.is_file():
            parts.extend(_sources(included, seen))
    return parts


def build(source_path: Path, cc: str | None = None) -> Path:
    """Compile ``source_path`` (or find its build in the cache) and return the shared object's path."""
    cc = cc or _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"cannot run the C compiler {cc!r}: {e}") from e
    sources = _sources(source_path)
    recipe = " ".join(COMPILE_FLAGS + ["&&"] + LINK_FLAGS + LIBS)
    key = hashlib.sha256(
        b"\0".join([*sources, recipe.encode(), version.encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"{source_path.stem}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: build into a temporary name and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        for command in (
            [cc, *COMPILE_FLAGS, "-o", obj, str(source_path)],
            [cc, *LINK_FLAGS, "-o", tmp, obj, *LIBS],
        ):
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise KernelUnavailable(f"building {source_path.name} with {cc} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"building {source_path.name} with {cc} failed: {e}") from e
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


class BuildOnce(Generic[T]):
    """``load()`` of one kernel: built and bound (``bind(path)``) once per process, and once per machine and
    source through the disk cache. Raises ``KernelUnavailable`` with the reason, every time, when it cannot
    be built or loaded."""

    def __init__(self, source_path: Path, bind: Callable[[Path], T]) -> None:
        self.source_path = source_path
        self.bind = bind
        self._lock = threading.Lock()
        self._loaded: T | KernelUnavailable | None = None

    def __call__(self) -> T:
        with self._lock:
            if self._loaded is None:
                try:
                    self._loaded = self.bind(build(self.source_path))
                except KernelUnavailable as e:
                    self._loaded = e
                except OSError as e:  # dlopen of a built file failed
                    self._loaded = KernelUnavailable(f"loading the built {self.source_path.name} failed: {e}")
            if isinstance(self._loaded, KernelUnavailable):
                raise self._loaded
            return self._loaded

    def available(self) -> bool:
        """Whether ``load()`` gives the kernel here (building it if need be) rather than raising."""
        try:
            self()
        except KernelUnavailable:
            return False
        return True
