"""Loading a model as ``tensor_parallel_size`` shards, one process per rank (torch.multiprocessing,
spawned): rank 0 is the calling process (the server); it hosts the ranks' rendezvous, starts ranks
1..N-1, and each rank connects, binds its threads to its cores and loads its shards from the same source:
the native model keeps only its slices of each tensor as read (engine/executor/parallel/sharding.py); the
transformers backend reads only its parts of a safetensors checkpoint under the model's own tensor-parallel
plan (engine/loader/transformers_slices.py, engine/executor/parallel/transformers_plan.py). Once every rank has loaded, ranks 1..N-1 serve rank 0's
messages (engine/executor/parallel/rank_loop.py) until it stops them or dies; rank 0 gets its shard with
the handle on the others (``workers``).

Under torchrun (engine/executor/parallel/torchrun.py) nothing is spawned: every rank is a ``cbserve``
process of its own, on one node or several, and they meet at ``MASTER_ADDR:MASTER_PORT``. Rank 0 goes on
to serve; in any other rank ``load_sharded`` never returns: the process serves rank 0's steps, then exits.

A rank that fails to start or to load makes ``load_sharded`` raise ``ModelLoadError`` (its own traceback
is in its log, on the inherited stderr): at once when its process exited, else after ``START_TIMEOUT_S``.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import NoReturn, Protocol, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from engine.errors import ModelLoadError
from engine.executor.fast_paths import apply_cpu_fast_paths
from engine.executor.models.llama import LlamaForCausalLM
from engine.executor.models.registry import MODEL_CLASSES
from engine.executor.parallel.cores import bind_to_rank_cores
from engine.executor.parallel.group import STORE_HOST, ShardGroup
from engine.executor.parallel.rank_loop import RankLoop
from engine.executor.parallel.sharded_llama import ShardedLlamaForCausalLM
from engine.executor.parallel.sharded_transformers import ShardedTransformersForCausalLM
from engine.executor.parallel.sharding import ShardingError, check_shardable, shard_weights
from engine.executor.parallel.torchrun import TorchrunRank
from engine.executor.parallel.workers import IDLE_TIMEOUT_S, ShardWorkers
from engine.loader.source import ModelSource, resolve_model
from engine.model_config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0  # a collective waits no longer for a rank
START_TIMEOUT_S = 600.0  # nor the ranks' start-up (spawn, imports, rendezvous) and loading, each


class OpenedWeights(Protocol):
    """What ``open_source`` gives (engine/loader/model_loader.py): the config and the lazy weights."""

    config: ModelConfig
    weights: Iterator[tuple[str, torch.Tensor]]


# NOTE: model_loader's open_source (native) or transformers_rank_model (a rank's transformers model, its
# parts in, and its planned modules), passed in: it crosses into the ranks' processes by its name.
Opener = Callable[[ModelSource, torch.dtype, torch.device], OpenedWeights]
HfOpener = Callable[[ModelSource, torch.dtype, torch.device, int, int], tuple[nn.Module, dict[str, str]]]

# A rank's shard: its forward runs the collectives; rank 0's holds the other ranks (``workers``).
ShardedModel = ShardedLlamaForCausalLM | ShardedTransformersForCausalLM


@dataclass(frozen=True)
class ShardSpec:
    """What every rank needs to load its shard (picklable: it crosses into the spawned processes)."""

    model: str
    load_format: str
    dtype: torch.dtype
    device: torch.device  # rank 0's; a CUDA model's rank uses the device of its index on its node
    world_size: int
    port: int  # the spawned ranks' store on 127.0.0.1 (none under torchrun)
    timeout_s: float
    opener: Opener | HfOpener
    prepack: bool  # the CPU fast paths of the native model (engine/executor/fast_paths.py)
    model_impl: str = "native"  # or "transformers"

    def device_of(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank) if self.device.type == "cuda" else self.device


def load_sharded(
    model: str,
    load_format: str,
    config: ModelConfig | None,
    dtype: torch.dtype,
    device: torch.device,
    world_size: int,
    opener: Opener | HfOpener,
    prepack: bool = True,
    timeout_s: float | None = None,
    model_impl: str = "native",
) -> ShardedModel:
    """Rank 0's shard of ``model``, the other ranks started and loaded. The native model (``config``, its
    config; ``opener``: ``open_source``) raises ``ShardingError`` (a ``ValueError``) before starting anything
    when ``world_size`` does not divide it; the transformers backend's (``config`` None; ``opener``
    builds a rank's transformers model, its parts in) is checked by the caller (``transformers_plan.planned_modules`` on the model
    built on the meta device). ``timeout_s``: how long a collective waits for a rank (``DEFAULT_TIMEOUT_S``).
    Under torchrun, ``world_size`` is its ``WORLD_SIZE``."""
    if config is not None:
        if MODEL_CLASSES.get(config.architecture) is not LlamaForCausalLM:
            raise ShardingError(
                f"tensor parallelism shards the Llama family's model code; {config.architecture!r} has its own"
            )
        check_shardable(config, world_size)
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    torchrun = TorchrunRank.from_env()  # NOTE: load_model checked that its WORLD_SIZE is world_size
    store: dist.Store
    if torchrun is None:
        start = datetime.timedelta(seconds=START_TIMEOUT_S)
        store = dist.TCPStore(STORE_HOST, 0, world_size, True, timeout=start, wait_for_workers=False)
        port = store.port
    else:
        store, port = torchrun.store(START_TIMEOUT_S), 0
    spec = ShardSpec(
        model, load_format, dtype, device, world_size, port, timeout_s, opener, prepack, model_impl
    )
    if torchrun is not None and torchrun.rank != 0:
        _serve_rank(torchrun.rank, spec, lambda: store, torchrun.local_rank, torchrun.local_world_size)
    processes = _spawn(spec) if torchrun is None else []
    try:
        _wait_for(store, "started", world_size, processes)  # NOTE: then the groups' own rendezvous is quick
        group = ShardGroup.connect(0, world_size, store, device, timeout_s, IDLE_TIMEOUT_S)
        net = _load_shard(spec, group)
        _wait_for(store, "loaded", world_size, processes)
    except Exception as exc:
        for process in processes:
            process.terminate()
        raise ModelLoadError(
            f"tensor parallelism: the {world_size} ranks could not start and load {model!r} ({exc}); "
            "see the other ranks' log lines above"
        ) from exc
    local_world_size = world_size if torchrun is None else torchrun.local_world_size
    net.workers = ShardWorkers(group, processes, local_world_size)
    return net


def _spawn(spec: ShardSpec) -> list[BaseProcess]:
    """Ranks 1..N-1 as processes of this machine, started."""
    context = mp.get_context("spawn")
    processes: list[BaseProcess] = [
        context.Process(target=_rank_main, args=(rank, spec), name=f"cbserve-tp-rank{rank}", daemon=True)
        for rank in range(1, spec.world_size)
    ]
    for process in processes:
        process.start()
    return processes


def _load_shard(spec: ShardSpec, group: ShardGroup) -> ShardedModel:
    device = group.device
    source = resolve_model(spec.model, spec.load_format)
    if spec.model_impl == "transformers":
        opener = cast(HfOpener, spec.opener)
        hf_model, modules = opener(source, spec.dtype, device, group.rank, group.world_size)
        return ShardedTransformersForCausalLM.shard(hf_model, modules, source.name, group)
    opened = cast(Opener, spec.opener)(source, spec.dtype, device)
    net = ShardedLlamaForCausalLM(opened.config, group, spec.dtype, device)
    with torch.no_grad():
        net.load_weights(shard_weights(opened.weights, opened.config, group.rank, group.world_size))
    net.shard()
    if spec.prepack:
        apply_cpu_fast_paths(net)
    net.eval()
    return net


def _wait_for(
    store: dist.Store, stage: str, world_size: int, processes: Sequence[BaseProcess], poll_s: float = 0.1
) -> None:
    """Until every other rank has reached ``stage`` (``started``, ``loaded``); ``RuntimeError`` when one
    of ``processes`` (the spawned ranks) exited first, or after ``START_TIMEOUT_S``."""
    keys = [f"{stage}/{rank}" for rank in range(1, world_size)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not store.check(keys):
        for rank, process in enumerate(processes, start=1):
            if not process.is_alive():
                raise RuntimeError(f"rank {rank}'s process exited (exit code {process.exitcode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ranks were not {stage} after {START_TIMEOUT_S:.0f} s")
        time.sleep(poll_s)


def _rank_main(rank: int, spec: ShardSpec) -> None:
    """A spawned rank's process: connect, load, serve rank 0 until told to stop; exit non-zero on any
    failure (and when rank 0's process is gone)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    _exit_with_parent()
    start = datetime.timedelta(seconds=START_TIMEOUT_S)
    _serve_rank(
        rank,
        spec,
        lambda: dist.TCPStore(STORE_HOST, spec.port, spec.world_size, False, timeout=start),
        rank,
        spec.world_size,
    )


def _serve_rank(
    rank: int,
    spec: ShardSpec,
    connect: Callable[[], dist.Store],
    local_rank: int,
    local_world_size: int,
) -> NoReturn:
    """Rank ``rank`` (``local_rank`` of the ``local_world_size`` ranks of its machine): connect to the
    ranks' store, load the shard, serve rank 0 until told to stop, then exit the process: code 0, or 1 on
    any failure."""
    try:
        bind_to_rank_cores(local_rank, local_world_size)
        device = spec.device_of(local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = connect()
        store.set(f"started/{rank}", "1")
        group = ShardGroup.connect(rank, spec.world_size, store, device, spec.timeout_s, IDLE_TIMEOUT_S)
        net = _load_shard(spec, group)
        store.set(f"loaded/{rank}", "1")
        RankLoop(net).run()
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    os._exit(0)


def _exit_with_parent(interval_s: float = 1.0) -> None:
    """Exit this process (code 1) once its parent, rank 0, is gone: a rank alone has nothing to do."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="cbserve-tp-parent", daemon=True).start()
