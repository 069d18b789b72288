"""Which implementation runs the decode part of paged attention: ``--attention-backend``.

- ``cpu``: the C kernel of ``cpu_kernel.py`` (CPU, float32 or bfloat16 caches, head_dim 64 or 128, block
  size a multiple of 16); an error at start-up if it cannot run here.
- ``sdpa``: PyTorch's ``scaled_dot_product_attention`` over gathered pages (any device, any dtype).
- ``auto`` (default): ``cpu`` where it can run, else ``sdpa``, saying why in the log.

The prefill part always runs in SDPA: it is bound by its matmuls, which SDPA does well.
"""

from __future__ import annotations

import logging

import torch

from engine.attention.cpu_kernel import KernelUnavailable, PagedDecodeKernel, load

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "cpu", "sdpa")


def select_decode_kernel(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    num_queries_per_kv: int,
) -> PagedDecodeKernel | None:
    """The CPU kernel when ``backend`` picks it, ``None`` for SDPA. Raises ``ValueError`` for an unknown
    backend, or for ``cpu`` when the kernel cannot run this model here."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "sdpa":
        return None
    kernel: PagedDecodeKernel | None = None
    if device.type != "cpu":
        reason: str | None = f"it runs on the CPU and the model is on {device}"
    else:
        try:
            kernel = load()
            reason = kernel.unsupported(head_dim, block_size, num_queries_per_kv, dtype)
        except KernelUnavailable as e:
            reason = str(e)
    if reason is None:
        return kernel
    if backend == "cpu":
        raise ValueError(f"attention backend 'cpu' cannot run here: {reason}")
    if device.type == "cpu":
        logger.warning("the CPU decode-attention kernel is not used (%s); decode attention runs in SDPA", reason)
    return None
