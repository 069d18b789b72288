"""KV-cache events through the engine loop (engine/loop.py): each step's events reach the observers in order,
so that replaying them gives the KV manager's cached hashes after prefix hits and evictions in a small cache;
``reset_prefix_cache`` clears the cache when idle (an ``AllBlocksCleared``) and refuses while a request
holds blocks. A tiny dummy Llama; the server's publisher is tests/server/test_kv_events_*.py."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest

from engine.engine import Engine
from engine.loader.model_loader import load_tokenizer
from engine.manager import ContinuousBatchingManager
from engine.model_config import ModelConfig
from kvcache.events import AllBlocksCleared, KVCacheEvent, replay

pytestmark = pytest.mark.slow  # the default model's tokenizer, read from its GGUF

BLOCK_SIZE = 4
NUM_BLOCKS = 12


class Collector:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[KVCacheEvent] = []

    def __call__(self, events: list[KVCacheEvent]) -> None:
        with self.lock:
            self.events += events


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, tiny_model_config: ModelConfig) -> Engine:
    folder = tmp_path_factory.mktemp("kv-events-dummy")
    config = tiny_model_config.replace(vocab_size=49152)  # the borrowed tokenizer's
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    load_tokenizer("default").save(folder)
    return Engine.from_pretrained(
        str(folder),
        load_format="dummy",
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
    )


@pytest.fixture
def manager(engine: Engine) -> Iterator[tuple[ContinuousBatchingManager, Collector]]:
    m = engine.init_continuous_batching(enable_kv_cache_events=True)
    collector = Collector()
    m.add_kv_event_observer(collector)
    m.start()
    yield m, collector
    m.stop()


def cached(m: ContinuousBatchingManager) -> set[int]:
    pool = m.scheduler.kv_manager.pool
    hashes = (pool.block_hash(b) for b in range(pool.num_blocks))
    return {h for h in hashes if h is not None}


def generate(m: ContinuousBatchingManager, prompt: list[int], max_new_tokens: int = 2) -> None:
    m.add_request(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
    out = m.get_result(timeout=60)
    assert out is not None and out.is_finished, out


def test_replayed_events_are_the_managers_cache(manager: tuple[ContinuousBatchingManager, Collector]) -> None:
    m, collector = manager
    document = list(range(100, 117))  # 4 full blocks
    for question in range(3):  # prefix hits on the document's blocks
        generate(m, [*document, 200 + question, 201, 202, 203])
        with collector.lock:
            assert replay(collector.events) == cached(m)
    assert m.scheduler.kv_manager.prefix_cache_hits >= 2 * 16
    for seed in range(4):  # other prompts: a 12-block cache evicts
        generate(m, [300 + 20 * seed + i for i in range(17)])
        with collector.lock:
            assert replay(collector.events) == cached(m)
    assert any(type(e).__name__ == "BlockRemoved" for e in collector.events)


def test_reset_clears_when_idle_and_refuses_while_blocks_are_held(
    manager: tuple[ContinuousBatchingManager, Collector],
) -> None:
    m, collector = manager
    generate(m, list(range(100, 117)))
    assert asyncio.run(m.reset_prefix_cache()) is True
    with collector.lock:
        assert collector.events[-1] == AllBlocksCleared() and replay(collector.events) == cached(m) == set()
    rid = m.add_request(list(range(100, 117)), max_new_tokens=20, ignore_eos=True, streaming=True)
    first = m.get_result(timeout=60)  # the request runs: it holds blocks until its last token
    assert first is not None and first.request_id == rid and not first.is_finished
    assert asyncio.run(m.reset_prefix_cache()) is False
    while not (out := m.get_result(timeout=60)) or not out.is_finished:
        assert out is not None
