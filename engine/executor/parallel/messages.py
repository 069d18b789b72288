"""What rank 0 sends the other ranks of a tensor-parallel model, one pickled message at a time
(``ShardGroup.send``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.executor.inputs import BatchInputs


@dataclass(frozen=True)
class AllocateCache:
    """Allocate (or re-allocate) the KV cache pages of this rank's heads and pick the decode kernel:
    the same blocks and kernel as rank 0's."""

    num_blocks: int
    block_size: int
    attention_backend: str  # engine/executor/attention/backend.py's name ("sdpa": none)


@dataclass(frozen=True)
class RunStep:
    """Copy these blocks (forks' copy-on-write), then run this batch through the shard (through its first
    ``num_layers`` layers only when given: a self-speculative draft)."""

    inputs: BatchInputs  # tensors in host memory
    blocks_to_copy: list[tuple[int, int]]
    num_layers: int | None = None


@dataclass(frozen=True)
class Heartbeat:
    """Nothing to run: rank 0 is alive (the other ranks wait for a message for a bounded time)."""


@dataclass(frozen=True)
class Stop:
    """Exit cleanly."""


Message = AllocateCache | RunStep | Heartbeat | Stop


def inputs_on(inputs: BatchInputs, device: torch.device) -> BatchInputs:
    """``inputs`` with every tensor on ``device`` (the same object where they already are)."""
    fields = {
        f.name: getattr(inputs, f.name).to(device)
        for f in dataclasses.fields(inputs)
        if isinstance(getattr(inputs, f.name), torch.Tensor)
    }
    if all(t is getattr(inputs, name) for name, t in fields.items()):
        return inputs
    return dataclasses.replace(inputs, **fields)
