"""Tensor parallelism of the transformers backend through the Python API (CPU, gloo, spawned ranks), for
architectures the native path does not serve, cut by the model's own tensor-parallel plan
(engine/executor/parallel/transformers_plan.py): greedy tokens with two ranks equal one process's, logprobs
within float rounding, under preemption; each rank's KV cache holds half the KV heads; a model without a
plan, or with styles cbserve does not apply, or heads two ranks cannot split, is refused before any rank
starts; a killed rank stops the engine and fails its requests."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from model_harness import save_tiny
from server_fixtures import wait_until

from engine.engine import Engine
from engine.errors import ExecutorFailedError
from engine.executor.parallel.sharding import ShardingError
from engine.outputs import GenerationOutput, RequestStatus

pytestmark = pytest.mark.slow  # spawns processes

LOGPROB_TOLERANCE = 1e-4
CACHE = {"num_blocks": 12, "block_size": 16, "max_model_len": 256}  # the three requests need 18: preemption
PROMPTS = [list(range(40, 80)), list(range(100, 130)), list(range(200, 235))]
MAX_NEW = 48
# name -> (transformers config class, fields over model_harness.TINY_BASE): plans with biases in every
# projection and the head (Phi), tied embeddings cut by vocabulary rows (Gemma, 301 rows: the last rank's
# padded)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "phi": ("PhiConfig", {"vocab_size": 301}),
    "gemma": ("GemmaConfig", {"vocab_size": 301}),
}


def _engine(folder: Path, tensor_parallel_size: int) -> Engine:
    return Engine.from_pretrained(
        str(folder),
        model_impl="transformers",
        device="cpu",
        dtype="float32",
        tensor_parallel_size=tensor_parallel_size,
        **CACHE,
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-tp-transformers")
    return {name: save_tiny(root / name, cls, fields) for name, (cls, fields) in ARCHS.items()}


@pytest.fixture(params=list(ARCHS))
def pair(request: pytest.FixtureRequest, folders: dict[str, Path]) -> Iterator[tuple[Engine, Engine]]:
    one, two = _engine(folders[request.param], 1), _engine(folders[request.param], 2)
    yield one, two
    two.close()


def _greedy(engine: Engine) -> list[GenerationOutput]:
    outputs = engine.generate_batch(
        PROMPTS,
        progress_bar=False,
        max_new_tokens=MAX_NEW,
        ignore_eos=True,
        do_sample=False,
        output_logprobs=True,
    )
    return [outputs[f"batch_req_{i}"] for i in range(len(PROMPTS))]


def test_two_ranks_give_one_process_tokens_under_preemption(pair: tuple[Engine, Engine]) -> None:
    one, two = pair
    assert two.num_kv_heads * 2 == one.num_kv_heads  # each rank's pages hold its own KV heads
    expected, got = _greedy(one), _greedy(two)
    for a, b in zip(expected, got, strict=True):
        assert a.status == b.status == RequestStatus.FINISHED, (a.error, b.error)
        assert b.generated_ids == a.generated_ids
        assert a.logprobs is not None and b.logprobs is not None
        worst = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True))
        assert worst < LOGPROB_TOLERANCE
    assert sum(o.num_preemptions for o in got) > 0  # the 12 blocks cannot hold the three at once


@pytest.mark.parametrize(
    ("cls", "fields", "size", "reason"),
    [
        ("StableLmConfig", {}, 2, "transformers has no tensor-parallel plan for StableLmForCausalLM"),
        (
            "MixtralConfig",
            {"num_local_experts": 4, "num_experts_per_tok": 2},
            2,
            "MixtralForCausalLM's tensor-parallel plan uses moe_tp_experts, packed_colwise; cbserve applies",
        ),
        ("PhiConfig", {"num_key_value_heads": 1}, 2, "must divide its 4 attention heads and its 1 KV heads"),
        ("PhiConfig", {}, 3, "tensor_parallel_size 3 must divide the 64 outputs of model.layers.0"),
    ],
)
def test_what_cannot_be_cut_is_refused_before_any_rank_starts(
    tmp_path: Path, cls: str, fields: dict[str, Any], size: int, reason: str
) -> None:
    folder = save_tiny(tmp_path / cls, cls, fields)
    with pytest.raises(ShardingError, match=reason):
        _engine(folder, size)


def test_a_killed_rank_stops_the_engine_and_fails_its_requests(folders: dict[str, Path]) -> None:
    engine = _engine(folders["phi"], 2)
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        rank1 = engine.model.workers.processes[0]  # type: ignore[union-attr]
        rid = manager.add_request(PROMPTS[0], max_new_tokens=150, ignore_eos=True, streaming=True)
        outputs = manager.request_id_iter(rid, timeout=60)
        assert not next(outputs).is_finished  # under way
        os.kill(rank1.pid, signal.SIGKILL)
        final = [out for out in outputs if out.is_finished][-1]
        assert final.status == RequestStatus.FAILED and "tensor parallelism failed" in (final.error or "")
        assert wait_until(lambda: not manager.is_running(), 10)
        assert isinstance(manager.executor_failure, ExecutorFailedError)
        assert "rank 1" in str(manager.executor_failure)
    finally:
        manager.stop(block=True, timeout=30)
        engine.close()
