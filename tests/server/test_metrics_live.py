"""/metrics of a live server, parsed with ``prometheus_client.parser``: every value moves as requests run.

A dedicated server (uvicorn in a thread over ``build_app``, no API key) so that no other test's requests
disturb the counts: each phase sends one request and checks the exact change of every metric it touches:
request outcomes by ``finished_reason`` (``length``, ``stop``, ``abort`` for a cancelled stream), token
counters equal to the response's ``usage``, the latency histograms' counts, the tokens computed per step,
the HTTP counter for the route and status; the gauges while a long stream runs; and the idle values
(nothing running or waiting, no KV block in use) after.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from executor_faults import FaultyExecutor
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import LiveServer, start_live_server, wait_until

from engine.loader.model_loader import LoadedModel
from server.config import ServerConfig

pytestmark = pytest.mark.slow  # the real model behind its own server

MODEL = "metrics-live"
M = {"model_name": MODEL}
Key = tuple[str, frozenset[tuple[str, str]]]


@dataclass
class Scrape:
    values: dict[Key, float]

    def get(self, name: str, **labels: str) -> float:
        """The sample ``name`` with exactly ``labels`` (0 when absent: a labelled series not yet seen)."""
        return self.values.get((name, frozenset(labels.items())), 0.0)

    def __sub__(self, other: Scrape) -> Delta:
        return Delta(self, other)


@dataclass
class Delta:
    after: Scrape
    before: Scrape

    def get(self, name: str, **labels: str) -> float:
        return self.after.get(name, **labels) - self.before.get(name, **labels)


@pytest.fixture(scope="module")
def live(default_model: LoadedModel) -> Iterator[LiveServer]:
    with start_live_server(
        ServerConfig(served_model_name=MODEL, shutdown_timeout=1),
        loaded=default_model,
        num_blocks=64,
        max_model_len=256,
        max_num_seqs=8,
    ) as server:
        yield server


def scrape(base_url: str) -> Scrape:
    resp = httpx.get(base_url + "/metrics", timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    values: dict[Key, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            values[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return Scrape(values)


def is_idle(s: Scrape) -> bool:
    return (
        s.get("cbserve:num_requests_running", **M) == 0
        and s.get("cbserve:num_requests_waiting", **M) == 0
        and s.get("cbserve:kv_cache_usage_perc", **M) == 0
    )


def check_finished_request(delta: Delta, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
    """The changes one finished single-sample request makes, with ``usage`` from its response."""
    for r in ("stop", "length", "abort", "error"):
        want = 1 if r == reason else 0
        assert delta.get("cbserve:request_success_total", finished_reason=r, **M) == want, r
    assert delta.get("cbserve:prompt_tokens_total", **M) == prompt_tokens
    assert delta.get("cbserve:generation_tokens_total", **M) == completion_tokens
    assert delta.get("cbserve:request_prompt_tokens_count", **M) == 1
    assert delta.get("cbserve:request_prompt_tokens_sum", **M) == prompt_tokens
    assert delta.get("cbserve:request_generation_tokens_sum", **M) == completion_tokens
    for histogram in (
        "cbserve:time_to_first_token_seconds",
        "cbserve:e2e_request_latency_seconds",
        "cbserve:request_queue_time_seconds",
        "cbserve:request_time_per_output_token_seconds",
    ):
        assert delta.get(histogram + "_count", **M) == 1, histogram
        assert delta.get(histogram + "_sum", **M) > 0, histogram
    assert delta.get("cbserve:inter_token_latency_seconds_count", **M) == completion_tokens - 1
    # The prompt is computed once, less what the prefix cache held (and samples the first token); each
    # later token is fed back once.
    cached = delta.get("cbserve:prefix_cache_hits_total", **M)
    assert 0 <= cached <= delta.get("cbserve:prefix_cache_queries_total", **M)
    assert delta.get("cbserve:iteration_tokens_total_count", **M) >= completion_tokens
    assert (
        delta.get("cbserve:iteration_tokens_total_sum", **M) == prompt_tokens - cached + completion_tokens - 1
    )


class EnginePause:
    """A ``FaultyExecutor`` ``before`` that holds the engine thread before the forward of its step
    ``after_steps + 1`` (the running request keeps its blocks, and the snapshot of the step before shows
    it running) until released: the gauges are then read while a request runs, however fast or slow the
    machine is."""

    def __init__(self, after_steps: int) -> None:
        self.after_steps = after_steps
        self.num_steps = 0
        self.paused = threading.Event()
        self.resume = threading.Event()

    def __call__(self, batch: object) -> None:
        self.num_steps += 1
        if self.num_steps > self.after_steps and not self.resume.is_set():
            self.paused.set()
            self.resume.wait(timeout=60)


def test_metrics_move_with_requests(live: LiveServer) -> None:
    base_url = live.base_url
    manager = live.state.manager
    assert manager is not None
    start = scrape(base_url)
    assert is_idle(start)
    assert start.get("cbserve:cache_config_info", block_size="16", num_blocks="64", **M) == 1
    http = httpx.Client(base_url=base_url, timeout=120)

    # --- a request that ends by length
    before = scrape(base_url)
    resp = http.post(
        "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
    )
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
    usage = resp.json()["usage"]
    text = resp.json()["choices"][0]["text"]
    delta = scrape(base_url) - before
    check_finished_request(delta, "length", usage["prompt_tokens"], usage["completion_tokens"])
    http_labels = {"method": "POST", "route": "/v1/completions"}
    assert delta.get("cbserve:http_requests_total", status="200", **http_labels) == 1
    assert delta.get("cbserve:http_request_duration_seconds_count", **http_labels) == 1

    # --- a request that ends on a stop string (a prefix of what greedy decoding writes here)
    stop = text.lstrip()[:3]
    assert stop, text
    before = scrape(base_url)
    chat = {
        "messages": [{"role": "user", "content": "Complete: The capital of France is"}],
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    resp = http.post(
        "/v1/chat/completions", json={**chat, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert resp.status_code == 200
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    chat_text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    chat_stop = chat_text.lstrip()[:4]
    assert chat_stop, chat_text
    delta = scrape(base_url) - before
    check_finished_request(delta, "length", events[-1]["usage"]["prompt_tokens"], 40)
    before = scrape(base_url)
    resp = http.post("/v1/chat/completions", json={**chat, "stop": [chat_stop]})
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "stop", resp.text
    usage = resp.json()["usage"]
    delta = scrape(base_url) - before
    check_finished_request(delta, "stop", usage["prompt_tokens"], usage["completion_tokens"])
    assert delta.get("cbserve:prefix_cache_hits_total", **M) > 0  # the same prompt as the stream's
    assert (
        delta.get("cbserve:http_requests_total", method="POST", route="/v1/chat/completions", status="200")
        == 1
    )

    # --- a long stream: the gauges show it while it runs; cancelling it counts an abort
    before = scrape(base_url)
    pause = EnginePause(after_steps=3)
    executor = manager.executor
    manager.executor = FaultyExecutor(executor, before=pause)
    body = {
        "prompt": "Write a long story:",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        try:
            assert pause.paused.wait(30), "the engine never reached its fourth step"
            during = scrape(base_url)
            assert during.get("cbserve:num_requests_running", **M) == 1
            assert during.get("cbserve:num_requests_waiting", **M) == 0
            assert during.get("cbserve:kv_cache_usage_perc", **M) > 0
        finally:
            pause.resume.set()
        num_deltas = 0
        for line in stream.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                num_deltas += 1
                if num_deltas >= 3:
                    break
    # leaving the block closes the connection: the request is cancelled
    assert wait_until(lambda: (scrape(base_url) - before).get(
        "cbserve:request_success_total", finished_reason="abort", **M) == 1, 30)  # fmt: skip
    manager.executor = executor
    delta = scrape(base_url) - before
    assert delta.get("cbserve:request_success_total", finished_reason="length", **M) == 0
    assert delta.get("cbserve:prompt_tokens_total", **M) > 0
    assert 3 <= delta.get("cbserve:generation_tokens_total", **M) < 200
    assert delta.get("cbserve:time_to_first_token_seconds_count", **M) == 1
    assert delta.get("cbserve:e2e_request_latency_seconds_count", **M) == 1

    # --- errors are counted by route and status; unknown paths under one label
    before = scrape(base_url)
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
    assert http.get("/no/such/route").status_code == 404
    delta = scrape(base_url) - before
    assert delta.get("cbserve:http_requests_total", status="400", **http_labels) == 1
    assert delta.get("cbserve:http_requests_total", method="GET", route="unmatched", status="404") == 1
    assert delta.get("cbserve:request_success_total", finished_reason="error", **M) == 0
    # the previous scrape itself was counted
    assert delta.get("cbserve:http_requests_total", method="GET", route="/metrics", status="200") == 1

    # --- back to idle
    assert wait_until(lambda: is_idle(scrape(base_url)), 15), scrape(base_url).values
    http.close()
