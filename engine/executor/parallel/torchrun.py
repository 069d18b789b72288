"""A rank started by torchrun (or anything that sets its variables): ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the environment. Then every rank is a ``cbserve``
process of its own, on one node or several; the ranks meet at the store on ``MASTER_ADDR:MASTER_PORT``
(torch.distributed's ``env://`` rendezvous: torchrun's agent hosts it, else rank 0), not at the store a
single ``cbserve`` hosts on 127.0.0.1 for the ranks it spawns (engine/loader/shards.py)."""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass

import torch.distributed as dist

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunRank:
    """This process's rank among ``world_size``, and among the ``local_world_size`` ranks of its node."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_env(cls) -> TorchrunRank | None:
        """The rank the environment names, or None where any of ``VARIABLES`` is unset (no torchrun).
        ``ValueError`` naming a variable that is no number."""
        if any(not os.environ.get(name) for name in VARIABLES):
            return None
        try:
            rank, world_size, local_rank = (int(os.environ[n]) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
        except ValueError as exc:
            raise ValueError(f"torchrun's environment: {exc}") from exc
        return cls(rank, world_size, local_rank, local_world_size)

    def store(self, timeout_s: float) -> dist.Store:
        """The ranks' store at ``MASTER_ADDR:MASTER_PORT``, under cbserve's own prefix (torchrun's agent
        keeps keys of its own there)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store, _rank, _world_size = next(dist.rendezvous("env://", timeout=timeout))
        return dist.PrefixStore("cbserve", store)


def exit_if_torchrun_rank(code: int) -> None:
    """Under torchrun, end this process now with ``code`` (after flushing its logs and output), as the other
    ranks end theirs: the interpreter's own shutdown could destroy the process groups' C++ threads while
    they still run (``terminate called without an active exception``, exit -6, seen once in a test run),
    and torchrun would then report the whole job failed. Without torchrun, nothing happens."""
    if TorchrunRank.from_env() is None:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
