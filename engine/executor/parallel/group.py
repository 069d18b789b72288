"""The ranks of one tensor-parallel model and the collectives between them (torch.distributed).

Two process groups over the same ranks, on one TCP store that rank 0 hosts:

- ``control`` (gloo, host memory): rank 0 broadcasts a message to the other ranks (each step's batch, the
  KV cache's shape, a heartbeat, the order to stop): a pickled object in one length and one bytes broadcast.
- ``compute`` (gloo on the CPU, NCCL on CUDA): the forward's all-reduces and its all-gather of logits.

Every wait is bounded: a collective that a dead or hung rank never joins raises ``RuntimeError`` after
``timeout_s`` (gloo raises at once when a peer's connection closes). A worker waits for rank 0's next
message at most ``idle_timeout_s``; rank 0 sends a heartbeat while idle (engine/executor/parallel/workers.py).
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

STORE_HOST = "127.0.0.1"  # the store of the ranks' rendezvous (one machine)


@dataclass
class ShardGroup:
    """This process's rank among ``world_size`` ranks, and the two process groups."""

    rank: int
    world_size: int
    device: torch.device
    store: dist.Store
    # NOTE: torch's c10d backends (ProcessGroupGloo, ProcessGroupNCCL) are typed without their collectives
    control: Any  # gloo
    compute: Any  # gloo or NCCL

    @classmethod
    def connect(
        cls,
        rank: int,
        world_size: int,
        store: dist.Store,
        device: torch.device,
        timeout_s: float,
        idle_timeout_s: float,
    ) -> ShardGroup:
        """Build the two groups over the ranks' ``store`` (rank 0 hosts it); every rank must call this.
        Raises ``RuntimeError`` when a rank does not join within ``timeout_s``."""
        # NOTE: rank 0 never waits on the control group for long (it only sends); the workers wait there
        # for the next step, idle_timeout_s at most (rank 0's heartbeat comes well before).
        control_timeout = datetime.timedelta(seconds=timeout_s if rank == 0 else idle_timeout_s)
        control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world_size, control_timeout)
        compute = _compute_group(
            dist.PrefixStore("compute", store),
            rank,
            world_size,
            device,
            datetime.timedelta(seconds=timeout_s),
        )
        return cls(rank, world_size, device, store, control, compute)

    # ------------------------------------------------------------------ the forward's collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place (``x`` contiguous); returns ``x``."""
        self.compute.allreduce([x]).wait()
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` ``[rows, cols]`` side by side, rank order: ``[rows, world_size * cols]``."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.compute.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------------ rank 0's messages
    def send(self, message: object) -> None:
        """Rank 0: broadcast ``message`` (any picklable object) to the other ranks."""
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        self.control.broadcast([torch.tensor([payload.numel()], dtype=torch.int64)], _root()).wait()
        self.control.broadcast([payload], _root()).wait()

    def receive(self) -> object:
        """The other ranks: rank 0's next message."""
        size = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast([size], _root()).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.control.broadcast([payload], _root()).wait()
        return pickle.loads(payload.numpy().tobytes())


def _root() -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


def _compute_group(
    store: dist.Store, rank: int, world_size: int, device: torch.device, timeout: datetime.timedelta
) -> Any:
    """gloo on the CPU, NCCL on CUDA (untested: no GPU machine ran it; docs/ARCHITECTURE.md)."""
    if device.type != "cuda":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise RuntimeError("tensor parallelism on CUDA needs a torch build with NCCL")
    options = nccl.Options()
    options._timeout = timeout
    return nccl(store, rank, world_size, options)
