"""Which implementation runs the decode part of paged attention: ``--attention-backend``.

- ``cpu``: the C kernel of ``cpu_kernel.py`` (CPU, float32 or bfloat16 caches, head_dim 64 or 128, block
  size a multiple of 16); an error at start-up if it cannot run here.
- ``triton``: the Triton kernel of ``triton_decode.py`` (CUDA, float32/bfloat16/float16, power-of-two
  head_dim and block size); an error at start-up if it cannot run here.
- ``sdpa``: PyTorch's ``scaled_dot_product_attention`` over gathered pages (any device, any dtype).
- ``auto`` (default): the device's kernel (``cpu`` on the CPU, ``triton`` on CUDA) where it can run, else
  ``sdpa``, saying why in the log.

The prefill part always runs in SDPA: it is bound by its matmuls, which SDPA does well.
"""

from __future__ import annotations

import logging

import torch

from engine.cpu.native_build import KernelUnavailable
from engine.executor.attention import cpu_kernel, triton_decode
from engine.executor.attention.decode_kernel import DecodeKernel

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "cpu", "triton", "sdpa")
_KERNEL_DEVICES = {"cpu": "cpu", "triton": "cuda"}  # backend -> the device type it runs on


def select_decode_kernel(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    num_queries_per_kv: int,
    softcap: float | None = None,
    batch_invariant: bool = False,
) -> DecodeKernel | None:
    """The kernel ``backend`` picks, ``None`` for SDPA. Raises ``ValueError`` for an unknown backend, or
    for ``cpu``/``triton`` when that kernel cannot run this model here (``softcap``: the model's attention
    logit soft-capping, which the Triton kernel does not compute)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}; expected one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if backend == "sdpa":
        return None
    wanted = backend if backend != "auto" else ("triton" if device.type == "cuda" else "cpu")
    kernel: DecodeKernel | None = None
    if device.type != _KERNEL_DEVICES[wanted]:
        reason: str | None = f"it runs on {_KERNEL_DEVICES[wanted]} and the model is on {device}"
    else:
        try:
            kernel = cpu_kernel.load() if wanted == "cpu" else triton_decode.load(batch_invariant)
            reason = kernel.unsupported(head_dim, block_size, num_queries_per_kv, dtype, softcap)
        except KernelUnavailable as e:
            reason = str(e)
    if reason is None:
        return kernel
    if backend != "auto":
        raise ValueError(f"attention backend {backend!r} cannot run here: {reason}")
    logger.warning(
        "the %s decode-attention kernel is not used (%s); decode attention runs in SDPA", wanted, reason
    )
    return None
