"""Tensor parallelism through the Python API (CPU, gloo, spawned ranks): greedy tokens with N ranks equal
one process's, logprobs within float rounding, under preemption, prefix caching and prompt-lookup drafts;
a model N does not divide is refused naming its numbers; a killed rank, or a hung one past the collectives'
timeout, stops the engine and fails its requests."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from default_engine import engine_on
from server_fixtures import wait_until

from engine.engine import Engine
from engine.errors import ExecutorFailedError
from engine.executor.parallel.sharding import ShardingError, check_shardable
from engine.loader.dummy import get_preset
from engine.loader.model_loader import LoadedModel, load_tokenizer
from engine.model_config import ModelConfig
from engine.outputs import GenerationOutput, RequestStatus

pytestmark = pytest.mark.slow  # spawns processes; the default model's tokenizer

LOGPROB_TOLERANCE = 1e-4
PREFIX = "You are a careful assistant. Answer in one short sentence, and mind the question: "
QUESTIONS = ("What is the sea?", "Why is the sky blue?", "Name a prime.", "Count to five.")
CACHE = {"num_blocks": 12, "block_size": 16, "max_model_len": 256}  # four requests need 20: preemption


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory, tiny_model_config: ModelConfig) -> Path:
    """The tiny random Llama (4 heads over 2 KV heads): N = 2 divides it. Its vocabulary (50,001 rows)
    leaves the last rank a padded row; the default model's tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-tp")
    config = tiny_model_config.replace(vocab_size=50001)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    load_tokenizer("default").save(folder)
    return folder


def _engine(folder: Path, tensor_parallel_size: int) -> Engine:
    return Engine.from_pretrained(
        str(folder),
        load_format="dummy",
        device="cpu",
        dtype="float32",
        tensor_parallel_size=tensor_parallel_size,
        **CACHE,
    )


@pytest.fixture(scope="module")
def tiny_pair(tiny_folder: Path) -> Any:
    one, two = _engine(tiny_folder, 1), _engine(tiny_folder, 2)
    yield one, two
    two.close()


def _greedy(engine: Engine, texts: tuple[str, ...], max_new_tokens: int) -> list[GenerationOutput]:
    prompts = [engine.tokenizer.encode(t) for t in texts]
    outputs = engine.generate_batch(
        prompts,
        progress_bar=False,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        do_sample=False,
        output_logprobs=True,
    )
    return [outputs[f"batch_req_{i}"] for i in range(len(prompts))]


def _one_after_another(engine: Engine, texts: tuple[str, ...], max_new_tokens: int) -> list[GenerationOutput]:
    """Each request after the previous one finished: the later ones find the shared prefix cached."""
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        finals = []
        for i, text in enumerate(texts):
            rid = manager.add_request(
                engine.tokenizer.encode(text),
                request_id=f"seq-{i}",
                max_new_tokens=max_new_tokens,
                ignore_eos=True,
                do_sample=False,
                output_logprobs=True,
            )
            finals.append([out for out in manager.request_id_iter(rid, timeout=120) if out.is_finished][-1])
        return finals
    finally:
        manager.stop(block=True, timeout=30)


def _assert_same(expected: list[GenerationOutput], got: list[GenerationOutput]) -> None:
    for a, b in zip(expected, got, strict=True):
        assert a.status == b.status == RequestStatus.FINISHED, (a.error, b.error)
        assert b.generated_ids == a.generated_ids
        assert a.logprobs is not None and b.logprobs is not None
        worst = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True))
        assert worst < LOGPROB_TOLERANCE


def test_two_ranks_give_one_process_tokens_under_preemption(tiny_pair: tuple[Engine, Engine]) -> None:
    one, two = tiny_pair
    texts = tuple(PREFIX + q for q in QUESTIONS)
    expected, got = _greedy(one, texts, 48), _greedy(two, texts, 48)
    _assert_same(expected, got)
    assert sum(o.num_preemptions for o in got) > 0  # the 12 blocks cannot hold the four at once


def test_two_ranks_give_one_process_tokens_from_the_prefix_cache(tiny_pair: tuple[Engine, Engine]) -> None:
    one, two = tiny_pair
    texts = tuple(PREFIX + q for q in QUESTIONS[:3])
    expected, got = _one_after_another(one, texts, 8), _one_after_another(two, texts, 8)
    _assert_same(expected, got)
    assert all(o.num_cached_tokens >= 16 for o in got[1:])  # the prefix's full blocks were hits


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_them(
    tiny_folder: Path, tiny_model_config: ModelConfig
) -> None:
    with pytest.raises(ShardingError, match="9 attention heads, its 3 KV heads .* shards into 1, 3"):
        check_shardable(get_preset("smollm2-135m"), 2)  # the default model's shape
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's 4 attention heads"):
        _engine(tiny_folder, 3)


def test_a_killed_rank_stops_the_engine_and_fails_its_requests(tiny_folder: Path) -> None:
    engine = _engine(tiny_folder, 2)
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        rank1 = engine.model.workers.processes[0]  # type: ignore[union-attr]
        rid = manager.add_request(
            engine.tokenizer.encode(PREFIX), max_new_tokens=150, ignore_eos=True, streaming=True
        )
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


def test_the_default_model_in_three_ranks_gives_one_process_tokens(default_model: LoadedModel) -> None:
    """SmolLM2-135M's 9 heads over 3 KV heads shard into 3 (not 2): three ranks on this machine."""
    one = engine_on(default_model, **CACHE)
    three = Engine.from_pretrained("default", device="cpu", tensor_parallel_size=3, **CACHE)
    try:
        texts = ("The capital of France is", "def fib(n):")
        _assert_same(_greedy(one, texts, 12), _greedy(three, texts, 12))
    finally:
        three.close()


def test_a_hung_rank_fails_the_step_after_the_collectives_timeout(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.loader import shards

    monkeypatch.setattr(shards, "DEFAULT_TIMEOUT_S", 3.0)
    engine = _engine(tiny_folder, 2)
    manager = engine.init_continuous_batching()
    manager.start()
    rank1 = engine.model.workers.processes[0]  # type: ignore[union-attr]
    try:
        rid = manager.add_request(
            engine.tokenizer.encode(PREFIX), max_new_tokens=150, ignore_eos=True, streaming=True
        )
        outputs = manager.request_id_iter(rid, timeout=60)
        assert not next(outputs).is_finished
        os.kill(rank1.pid, signal.SIGSTOP)  # alive, but never joins another collective
        final = [out for out in outputs if out.is_finished][-1]
        assert final.status == RequestStatus.FAILED and "Timed out waiting 3000ms" in (final.error or "")
        assert wait_until(lambda: not manager.is_running(), 10)
        assert isinstance(manager.executor_failure, ExecutorFailedError)
    finally:
        os.kill(rank1.pid, signal.SIGKILL)
        manager.stop(block=True, timeout=30)
        engine.close()


@pytest.mark.parametrize("drafts", [{"prompt_lookup_num_tokens": 4}, {"assistant_early_exit": 1}])
def test_two_ranks_verify_drafts_as_one_process_decodes(
    tiny_pair: tuple[Engine, Engine], drafts: dict[str, int]
) -> None:
    """A verify chunk (a token and its drafts as decode rows) is broadcast like any batch, and so is an
    early-exit draft (the first layers only): the greedy tokens with drafts on two ranks are one process's
    plain ones."""
    one, two = tiny_pair
    ids = one.tokenizer.encode("one two three four five, one two three four five, one two three four five,")
    plain = one.generate_batch([ids], progress_bar=False, max_new_tokens=48, ignore_eos=True, do_sample=False)
    manager = two.init_continuous_batching()
    manager.start()
    try:
        rid = manager.add_request(ids, max_new_tokens=48, ignore_eos=True, do_sample=False, **drafts)
        final = [out for out in manager.request_id_iter(rid, timeout=120) if out.is_finished][-1]
        assert manager.stats().spec_num_drafts > 0
    finally:
        manager.stop(block=True, timeout=30)
    assert final.generated_ids == plain["batch_req_0"].generated_ids


@pytest.mark.parametrize("options", [{"dola_layers": [0, 1]}, {"prompt_logprobs": 2}])
def test_two_ranks_give_one_process_dola_and_prompt_logprobs(
    tiny_pair: tuple[Engine, Engine], options: dict[str, Any]
) -> None:
    """DoLa's early exits and every prompt row's logits go through the vocabulary-parallel head too."""
    one, two = tiny_pair
    ids = one.tokenizer.encode(PREFIX)
    kw = {"progress_bar": False, "max_new_tokens": 8, "ignore_eos": True, "do_sample": False, **options}
    a, b = one.generate_batch([ids], **kw)["batch_req_0"], two.generate_batch([ids], **kw)["batch_req_0"]
    assert a.status == b.status == RequestStatus.FINISHED, (a.error, b.error)
    assert b.generated_ids == a.generated_ids
    if "prompt_logprobs" in options:
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        rows = zip(a.prompt_logprobs, b.prompt_logprobs, strict=True)
        pairs = [(x.logprob, y.logprob) for x, y in rows if x and y]
        assert len(pairs) == len(ids) - 1
        assert max(abs(x - y) for x, y in pairs) < LOGPROB_TOLERANCE
