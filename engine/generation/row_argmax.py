"""Each row's maximum and the first column that holds it, in one C pass (``csrc/row_argmax.c``): the
sampler's greedy pick and its checks for NaN and infinite rows, on CPU float32 logits.

Why: ``torch.argmax`` on the CPU tracks its index a lane at a time (~1 ms for 16 rows of SmolLM2's 49,152
logits on the benchmark machine); the sampler's blocked ``amax`` + ``argmax`` in PyTorch took 0.35-0.6 ms a
step of 16 rows; this pass takes ~0.1 ms for them, ~20 us for one row (``python -m bench.sampler``;
docs/BENCHMARKS.md). The results are those of
``logits.amax(dim=1)`` (NaN where a row has one) and ``logits.argmax(dim=1)`` (the first maximum; -1 for a
row with a NaN), bit for bit.

``load()`` returns the kernel or raises ``KernelUnavailable`` (no compiler, a failed build); the sampler then
keeps its PyTorch path, as it does for logits on other devices.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.cpu.native_build import BuildOnce

SOURCE = Path(__file__).with_name("csrc") / "row_argmax.c"


class RowArgmax:
    """``ctypes`` binding: ``kernel(logits [R, V] float32 CPU) -> (maxima [R] float32, first [R] int64)``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn = lib.cbserve_row_argmax
        self._fn.argtypes = [ptr, i64, i64, i64, ptr, ptr]
        self._fn.restype = None

    @staticmethod
    def takes(logits: torch.Tensor) -> bool:
        """Whether ``logits`` is what the kernel reads: 2-D float32 on the CPU, each row contiguous."""
        return (
            logits.dim() == 2
            and logits.device.type == "cpu"
            and logits.dtype == torch.float32
            and logits.stride(1) == 1
            and logits.shape[1] < 2**31  # columns as int32 in the C loop
        )

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.takes(logits):
            raise ValueError(f"expected 2-D float32 CPU rows, got {logits.dtype} {tuple(logits.shape)}")
        rows, cols = logits.shape
        maxima = torch.empty(rows, dtype=torch.float32)
        first = torch.empty(rows, dtype=torch.int64)
        if rows:
            self._fn(logits.data_ptr(), logits.stride(0), rows, cols, maxima.data_ptr(), first.data_ptr())
        return maxima, first


load = BuildOnce(SOURCE, RowArgmax)
