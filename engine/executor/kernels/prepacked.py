"""CPU matmuls through oneDNN with each weight reordered once, at load time, into the blocked layout its
kernels read ("prepacked"), as ``torch.compile``'s freezing does for CPU inference.

``F.linear`` on the CPU calls MKL's sgemm, which re-packs the weight matrix on every call; for this
model's shapes that is half of the matmul's time at decode batch sizes. The prepacked oneDNN call was
1.3-1.8x faster per step on the benchmark machine (docs/BENCHMARKS.md). The results agree with ``F.linear``
to float rounding (the sums run in another order).

A prepacked weight is an opaque ``torch._mkldnn`` tensor: it can only be passed back to ``linear``.
"""

from __future__ import annotations

import torch

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build prepacks weights of ``dtype`` on ``device`` (CPU builds with oneDNN), and,
    for bfloat16, whether this CPU has the instructions oneDNN's bfloat16 path needs (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT: an AVX2-only CPU such as AMD Zen 3 has neither, and its matmuls stay on ``F.linear``)."""
    return (
        device.type == "cpu"
        and dtype in PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (dtype != torch.bfloat16 or _cpu_has_bf16_matmuls())
    )


def _cpu_has_bf16_matmuls() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out_features, in_features]`` in oneDNN's blocked layout (a new tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` with ``W`` from ``prepack``; ``x`` is ``[..., in_features]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
