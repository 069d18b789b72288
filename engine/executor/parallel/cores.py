"""Each rank's CPU cores: the cores this process may use, cut into ``world_size`` equal runs, rank ``r``
taking run ``r`` (on a two-socket server whose cores are numbered socket by socket, one rank per socket;
docs/DEPLOY.md). A rank's compute threads are bound to its run and number as many as its cores."""

from __future__ import annotations

import os

import torch


def rank_cores(rank: int, world_size: int) -> list[int]:
    """The cores of rank ``rank`` (all of them where there are fewer cores than ranks)."""
    allowed = sorted(os.sched_getaffinity(0))
    per_rank = len(allowed) // world_size
    if per_rank == 0:
        return allowed
    return allowed[rank * per_rank : (rank + 1) * per_rank]


def bind_to_rank_cores(rank: int, world_size: int) -> list[int]:
    """Bind the calling thread (and the threads it starts from now on) to rank ``rank``'s cores and size
    torch's intra-op pool to them; returns the cores."""
    cores = rank_cores(rank, world_size)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return cores
