"""KV-cache events over ZMQ from a live server (server/kv_events.py): a subscriber that sees nothing but the
events rebuilds exactly the set of blocks the KV manager holds in its prefix cache, through prefix hits,
evictions in a tiny cache and ``POST /flush_cache``; a late subscriber catches up through the replay socket.
Also what SGLang's model gateway reads of a worker (server/serving_worker.py).

The server runs the default model with 24 blocks of 16 tokens; the subscriber binds a free local port and the
server's PUB socket connects to it (vLLM's rule: an endpoint without a wildcard host is connected).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest
import zmq
from server_fixtures import LiveServer, free_port, start_live_server, wait_until

from engine.loader.model_loader import LoadedModel
from server.config import ServerConfig
from server.kv_events_config import KVEventsConfig

pytestmark = pytest.mark.slow  # the real model behind its own server

MODEL = "kv-events-live"
TOPIC = "kv"
BLOCK_SIZE = 16
NUM_BLOCKS = 24


class Mirror:
    """Rebuilds one replica's cached hashes from its event stream alone."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.seqs: list[int] = []
        self.events: list[list[Any]] = []

    def apply(self, seq: bytes, payload: bytes) -> None:
        self.seqs.append(int.from_bytes(seq, "big"))
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and dp_rank == 0
        for event in events:
            self.events.append(event)
            kind = event[0]
            if kind == "BlockStored":
                _, hashes, parent, token_ids, block_size, lora_id, medium = event
                assert block_size == BLOCK_SIZE and len(token_ids) == len(hashes) * BLOCK_SIZE
                assert lora_id is None and medium == "CPU" and (parent is None or len(parent) == 16)
                self.cached.update(int.from_bytes(h, "little") for h in hashes)
            elif kind == "BlockRemoved":
                _, hashes, medium = event
                self.cached.difference_update(int.from_bytes(h, "little") for h in hashes)
            else:
                assert event == ["AllBlocksCleared"]
                self.cached.clear()


class Subscriber(threading.Thread):
    """A router's subscriber: its own thread receives all the time (a SUB socket sends its subscription
    only while its owner uses it) and applies each batch to ``mirror`` under ``lock``."""

    def __init__(self, port: int) -> None:
        super().__init__(name="kv-events-subscriber", daemon=True)
        self.port = port
        self.mirror = Mirror()
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
            sock.bind(f"tcp://127.0.0.1:{self.port}")
            self.ready.set()
            while not self.stopping.is_set():
                if sock.poll(50):
                    topic, seq, payload = sock.recv_multipart()
                    assert topic == TOPIC.encode()
                    with self.lock:
                        self.mirror.apply(seq, payload)
        except BaseException as exc:  # a malformed batch: the test reads it
            self.error = exc
        finally:
            sock.close(linger=0)


def held_hashes(live: LiveServer) -> set[int]:
    """The hashes the engine's KV manager has cached (read while the engine is idle)."""
    assert live.state.manager is not None
    pool = live.state.manager.scheduler.kv_manager.pool
    hashes = (pool.block_hash(b) for b in range(pool.num_blocks))
    return {h for h in hashes if h is not None}


@pytest.fixture(scope="module")
def sub_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def replay_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def subscriber(sub_port: int) -> Iterator[Subscriber]:
    sub = Subscriber(sub_port)
    sub.start()
    assert sub.ready.wait(10)
    yield sub
    sub.stopping.set()
    sub.join(5)


@pytest.fixture(scope="module")
def live(
    subscriber: Subscriber, sub_port: int, replay_port: int, default_model: LoadedModel
) -> Iterator[LiveServer]:
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://127.0.0.1:{sub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic=TOPIC,
    )
    config = ServerConfig(served_model_name=MODEL, shutdown_timeout=1, kv_events=events)
    with start_live_server(
        config, loaded=default_model, num_blocks=NUM_BLOCKS, max_model_len=256, max_num_seqs=4
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.base_url, timeout=60) as client:
        yield client


def complete(http: httpx.Client, prompt: list[int], max_tokens: int = 2) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text


def in_sync(live: LiveServer, sub: Subscriber) -> bool:
    """Bounded wait: the engine idle and the subscriber's set equal to the manager's."""

    def check() -> bool:
        assert sub.error is None, sub.error
        with sub.lock:
            return live.wait_idle(0) and sub.mirror.cached == held_hashes(live)

    return wait_until(check, timeout=10)


def document(seed: int, length: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 31) % 20000 for i in range(length)]


def test_the_subscriber_mirrors_hits_evictions_and_a_flush(
    live: LiveServer, http: httpx.Client, subscriber: Subscriber
) -> None:
    doc = document(1, 100)  # 6 full blocks
    complete(http, doc)
    assert in_sync(live, subscriber) and len(subscriber.mirror.cached) == 6
    first = subscriber.mirror.events[0]
    assert first[0] == "BlockStored" and first[2] is None and first[3][:BLOCK_SIZE] == doc[:BLOCK_SIZE]

    for question in range(3):  # the document's blocks are hits; each question adds its own tail
        complete(http, [*doc, *document(50 + question, 20)])
    assert in_sync(live, subscriber)
    assert live.state.manager is not None and live.state.manager.stats().prefix_cache_hits >= 3 * 96

    for seed in range(2, 8):  # more documents than the 24-block cache holds: older blocks are evicted
        complete(http, document(seed, 120))
        assert in_sync(live, subscriber)
    assert any(event[0] == "BlockRemoved" for event in subscriber.mirror.events)

    r = http.post("/flush_cache")
    assert r.status_code == 200, r.text
    assert in_sync(live, subscriber) and subscriber.mirror.cached == set()
    assert subscriber.mirror.events[-1] == ["AllBlocksCleared"]
    complete(http, doc)  # and it fills again
    assert in_sync(live, subscriber) and len(subscriber.mirror.cached) == 6
    assert subscriber.mirror.seqs == list(range(len(subscriber.mirror.seqs)))  # no gap


def test_a_late_subscriber_catches_up_through_the_replay_socket(
    live: LiveServer, http: httpx.Client, subscriber: Subscriber, replay_port: int
) -> None:
    complete(http, document(9, 40))
    assert in_sync(live, subscriber)
    late = Mirror()
    dealer = zmq.Context.instance().socket(zmq.DEALER)  # one request, many replies: not a REQ socket
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            late.apply(seq, payload)
    finally:
        dealer.close(linger=0)
    with subscriber.lock:
        assert late.seqs == subscriber.mirror.seqs
        assert late.cached == subscriber.mirror.cached == held_hashes(live)


def test_flush_is_refused_while_a_request_holds_blocks(live: LiveServer, http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": document(3, 30), "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()  # NOTE: kept: a closed iterator would close the stream (a cancel)
        assert next(line for line in lines if line.startswith("data: {"))  # the request runs
        r = http.post("/flush_cache")
        assert r.status_code == 409 and r.json()["error"]["code"] == "cache_in_use"
    assert live.wait_idle()


def test_what_the_gateway_reads_of_a_worker(live: LiveServer, http: httpx.Client) -> None:
    info = http.get("/server_info").json()
    assert info["served_model_name"] == MODEL and info["dp_size"] == 1 and info["page_size"] == BLOCK_SIZE
    assert http.get("/get_server_info").json() == info
    model = http.get("/model_info").json()
    assert model["is_generation"] is True and model["architectures"] == ["LlamaForCausalLM"]
    assert http.get("/get_model_info").json() == model
    assert not {"model_path", "tokenizer_path"} & (set(info) | set(model))  # the gateway would fetch them
    assert live.wait_idle()
    (load,) = http.get("/get_load").json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    metrics = http.get("/metrics").text
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert f'{name}{{model_name="{MODEL}"}} 0.0' in metrics
    assert 'vllm:cache_config_info{block_size="16",model_name="' + MODEL in metrics
    assert 'vllm:lora_requests_info{max_lora="0"' in metrics
    assert json.loads(http.get("/health").text) == {"status": "ok"}
