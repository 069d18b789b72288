"""The CPU decode-attention kernel (``csrc/paged_decode.c``): built with the system C compiler on first use,
cached on disk, called through ``ctypes``.

Why C: on the CPU, decode attention is bound by reading the KV pages. The PyTorch path gathers every
sequence's pages into a padded copy and then runs SDPA over it -- three passes over the cache per layer,
plus the padding. The kernel reads each page once, in place, through the block table.

Why ``cc`` + ``ctypes`` and not a torch C++ extension: the file is plain C (no torch headers), so it
compiles in well under a second; it is built with ``-march=native`` for the machine it runs on, and the
shared object is cached under ``$XDG_CACHE_HOME/cbserve/kernels`` keyed by the source, the flags, the
compiler and the CPU, so a different machine or a changed source never loads a stale build. ``ctypes``
releases the GIL during the call.

``load()`` returns the kernel or raises ``KernelUnavailable`` with the reason (no compiler, a failed build);
callers that choose the backend automatically fall back to the PyTorch path on that error.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# -ffast-math lets the compiler reassociate the sums into SIMD lanes and call libmvec's vectorised expf.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
# NOTE: linked in a second step WITHOUT -ffast-math: linking with it adds crtfastmath.o, whose constructor
# sets flush-to-zero and denormals-are-zero in the CPU's control register for the whole process -- every
# float op of torch, numpy and Python itself would change (hypothesis's float strategies refuse to run).
LINK_FLAGS = ["-shared", "-fopenmp"]
LIBS = ["-lm"]  # libmvec (the vectorised expf) comes with libm
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


class KernelUnavailable(RuntimeError):
    """The CPU kernel cannot be used here (no C compiler, a failed build, an unsupported shape)."""


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


def build(cc: str | None = None) -> Path:
    """Compile the kernel (or find it in the cache) and return the shared object's path."""
    cc = cc or _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"cannot run the C compiler {cc!r}: {e}") from e
    source = SOURCE.read_bytes()
    recipe = " ".join(COMPILE_FLAGS + ["&&"] + LINK_FLAGS + LIBS)
    key = hashlib.sha256(
        b"\0".join([source, recipe.encode(), version.encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: build into a temporary name and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        for command in (
            [cc, *COMPILE_FLAGS, "-o", obj, str(SOURCE)],
            [cc, *LINK_FLAGS, "-o", tmp, obj, *LIBS],
        ):
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise KernelUnavailable(f"building {SOURCE.name} with {cc} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"building {SOURCE.name} with {cc} failed: {e}") from e
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


class PagedDecodeKernel:
    """``ctypes`` binding of ``cbserve_paged_decode_attention``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        fn = self._lib.cbserve_paged_decode_attention
        fn.restype = ctypes.c_int
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, i64, ptr, ptr, ctypes.c_int, ptr, i64, ptr, i64, i64, i64, i64, i64]
        fn.argtypes += [ctypes.c_float, i64]
        self._fn = fn
        self.lanes = int(self._lib.cbserve_lanes())
        self.max_group = int(self._lib.cbserve_max_group())
        self.max_head_dim = int(self._lib.cbserve_max_head_dim())

    def unsupported(self, head_dim: int, block_size: int, group: int, dtype: torch.dtype) -> str | None:
        """Why this configuration cannot use the kernel, or None when it can."""
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {dtype} (supported: float32, bfloat16)"
        if head_dim % self.lanes or head_dim > self.max_head_dim:
            return f"head_dim {head_dim} (must be a multiple of {self.lanes}, at most {self.max_head_dim})"
        if block_size % self.lanes:
            return f"block_size {block_size} (must be a multiple of {self.lanes})"
        if group > self.max_group:
            return f"{group} query heads per KV head (at most {self.max_group})"
        return None

    def __call__(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query per sequence
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size]
        v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, >= pages] int64
        seq_lens: torch.Tensor,  # [num_seqs] int64, >= 1
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Attention of each sequence's query over its pages: ``[num_seqs, num_heads, head_dim]`` in q's
        dtype."""
        num_seqs, num_heads, head_dim = q.shape
        num_blocks, num_kv_heads, _, block_size = k_cache.shape
        qf = q.float()
        if qf.stride(2) != 1 or qf.stride(1) != head_dim:
            qf = qf.contiguous()
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype):
            raise ValueError("the K and V caches must be contiguous tensors of one dtype")
        if block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
            raise ValueError("block_tables and seq_lens must be int64")
        tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
        lens = seq_lens.contiguous()
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
        rc = self._fn(
            out.data_ptr(),
            qf.data_ptr(),
            qf.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.bfloat16),
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            sliding_window or 0,
        )
        if rc == -2:
            raise KernelUnavailable(
                f"unsupported shape: heads {num_heads}/{num_kv_heads}, head_dim {head_dim}, block {block_size}"
            )
        if rc != 0:
            raise MemoryError("paged decode attention: out of memory for its scratch buffers")
        return out if q.dtype == torch.float32 else out.to(q.dtype)


_lock = threading.Lock()
_loaded: PagedDecodeKernel | KernelUnavailable | None = None


def load() -> PagedDecodeKernel:
    """The kernel, built once per process (and once per machine and source, through the disk cache).
    Raises ``KernelUnavailable`` with the reason, every time, when it cannot be built or loaded."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                _loaded = PagedDecodeKernel(build())
            except KernelUnavailable as e:
                _loaded = e
            except OSError as e:  # dlopen of a built file failed
                _loaded = KernelUnavailable(f"loading the built kernel failed: {e}")
        if isinstance(_loaded, KernelUnavailable):
            raise _loaded
        return _loaded
