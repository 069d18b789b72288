"""Overload: ten times ``--max-queue`` requests at once against a server whose queue is tiny. The excess
is refused at once with 429 and the OpenAI error body (``rate_limit_error`` / ``queue_full``); every
request that was accepted completes in full (streaming or not); afterwards the server is idle and admits
again. One request with more prompts than the whole queue holds is a 400 (it could never be admitted),
not a 429.

A dedicated server (``start_live_server``: uvicorn in a thread over ``build_app``) with ``max_queue=3`` and
two sequences running at most, so that most of the burst must wait and the queue really fills.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_fixtures import LiveServer, start_live_server, wait_until

from engine.loader.model_loader import LoadedModel
from server.config import ServerConfig

MAX_QUEUE = 3
MAX_NUM_SEQS = 2
NUM_REQUESTS = 10 * MAX_QUEUE
MAX_TOKENS = 8
BURST_TIMEOUT_S = 180.0


pytestmark = pytest.mark.slow  # the real model behind its own server


@pytest.fixture(scope="module")
def server(default_model: LoadedModel) -> Iterator[LiveServer]:
    config = ServerConfig(served_model_name="overload", max_queue=MAX_QUEUE, shutdown_timeout=1)
    with start_live_server(
        config, loaded=default_model, num_blocks=64, max_model_len=256, max_num_seqs=MAX_NUM_SEQS
    ) as server:
        yield server


def body(i: int) -> dict[str, Any]:
    return {
        "prompt": f"Request {i} of the burst:",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": i % 3 == 0,
    }


async def send(client: httpx.AsyncClient, i: int) -> tuple[int, Any]:
    """(status, parsed answer): the JSON body, or for a stream the list of its events."""
    async with client.stream("POST", "/v1/completions", json=body(i)) as resp:
        raw = await resp.aread()
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
            return resp.status_code, [e if e == "[DONE]" else json.loads(e) for e in events]
        return resp.status_code, json.loads(raw)


async def burst(base_url: str) -> list[tuple[int, Any]]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        return await asyncio.wait_for(
            asyncio.gather(*(send(client, i) for i in range(NUM_REQUESTS))), BURST_TIMEOUT_S
        )


def test_burst_beyond_the_queue_gets_429_and_the_rest_completes(server: LiveServer) -> None:
    results = asyncio.run(burst(server.base_url))
    statuses = [status for status, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    accepted = [(i, answer) for i, (status, answer) in enumerate(results) if status == 200]
    refused = [answer for status, answer in results if status == 429]
    # The queue holds MAX_QUEUE; a few more may be running or done before the burst is over, but most of
    # the burst is beyond what the server can hold.
    assert MAX_QUEUE <= len(accepted) <= NUM_REQUESTS // 2, statuses
    for answer in refused:
        assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
        assert answer["error"]["type"] == "rate_limit_error" and answer["error"]["code"] == "queue_full"
        assert str(MAX_QUEUE) in answer["error"]["message"]
    for i, answer in accepted:
        if body(i)["stream"]:
            assert answer[-1] == "[DONE]", answer
            chunks = answer[:-1]
            assert all("error" not in c for c in chunks), chunks
            assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        else:
            assert answer["usage"]["completion_tokens"] == MAX_TOKENS, answer
            assert answer["choices"][0]["finish_reason"] == "length"

    manager = server.state.manager
    assert manager is not None
    assert wait_until(
        lambda: manager.stats().num_requests_waiting == 0 and manager.stats().kv_cache_usage == 0, 30
    )
    manager.check_integrity()
    # The queue is empty again: a new request is admitted and served.
    resp = httpx.post(server.base_url + "/v1/completions", json={**body(1), "stream": False}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_more_prompts_than_the_queue_holds_is_a_400_not_a_429(server: LiveServer) -> None:
    assert server.wait_idle(timeout=30)
    too_many = {"prompt": [f"Prompt {i}" for i in range(MAX_QUEUE + 1)], "max_tokens": 2}
    resp = httpx.post(server.base_url + "/v1/completions", json=too_many, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "request_too_large" and error["param"] == "prompt", error
    assert str(MAX_QUEUE + 1) in error["message"] and str(MAX_QUEUE) in error["message"]
    # As many prompts as the queue holds, each with n = 2 samples (they share their prompt's entry): served.
    fits = {"prompt": [f"Prompt {i}" for i in range(MAX_QUEUE)], "max_tokens": 2, "n": 2, "ignore_eos": True}
    resp = httpx.post(server.base_url + "/v1/completions", json=fits, timeout=120)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 2 * MAX_QUEUE
