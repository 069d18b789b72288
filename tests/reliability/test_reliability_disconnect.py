"""Disconnect storm: clients that hang up at random points (before the response starts, after a few events,
mid-stream; completions and chat; n = 1 and 2) must leave nothing behind: every KV block free again
(``cbserve:kv_cache_usage_perc`` 0 and no request running, as /metrics reports it, within seconds), the
scheduler's invariants intact (``check_integrity()``), no response counted in flight, and the next
request served normally. The same for non-streaming clients that give up before their answer (beam
searches among them), and for a
storm of constrained streams (JSON schemas, regexes, tool calls forced and ``auto``), which must also
leave no grammar matcher behind (``cbserve:num_grammar_matchers`` 0, and no ``GrammarMatcher`` object
more in the process than before the storm).
"""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import LiveServer, wait_until

from engine.generation.grammar import GrammarMatcher

NUM_STREAMS = 100
NUM_CONSTRAINED_STREAMS = 60
CONCURRENCY = 16
MAX_TOKENS = 24
STORM_TIMEOUT_S = 240.0
IDLE_TIMEOUT_S = 15.0  # generous: the machine is shared; an idle engine gets there in one step


def scrape(base_url: str) -> dict[str, float]:
    """``{sample name: value}`` of the engine gauges on /metrics, plus ``abort``: the cancelled samples."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("cbserve:num_") or sample.name == "cbserve:kv_cache_usage_perc":
                values[sample.name] = sample.value
            if sample.name == "cbserve:request_success_total" and sample.labels["finished_reason"] == "abort":
                values["abort"] = sample.value
    return values


def metrics_idle(base_url: str) -> bool:
    m = scrape(base_url)
    return (
        m.get("cbserve:kv_cache_usage_perc") == 0.0
        and m.get("cbserve:num_requests_running") == 0.0
        and m.get("cbserve:num_requests_waiting") == 0.0
        and m.get("cbserve:num_grammar_matchers") == 0.0
    )


def assert_all_released(live_server: LiveServer) -> None:
    manager = live_server.state.manager
    assert manager is not None
    assert wait_until(lambda: metrics_idle(live_server.base_url), IDLE_TIMEOUT_S), scrape(
        live_server.base_url
    )
    assert live_server.wait_idle(timeout=IDLE_TIMEOUT_S), manager.stats()
    assert manager.stats().num_grammar_matchers == 0, manager.stats()
    manager.check_integrity()  # the loop is idle: the allocator's and scheduler's books must balance
    assert wait_until(lambda: live_server.state.num_active == 0, IDLE_TIMEOUT_S), live_server.state.num_active


def request_body(rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    n = 2 if i % 5 == 0 else 1
    prompt = f"Story {i}: once upon a time" + " there was a dragon" * rng.randint(0, 12)
    common = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True, "n": n}
    if i % 2:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}
    return "/v1/completions", {"prompt": prompt, **common}


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "city", "age"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def constrained_body(rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    """A constrained stream: a JSON schema, a regex, a forced or ``auto`` tool call; sampled, so that the
    outputs differ and run long enough to be cut."""
    common = {
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": i,
        "stream": True,
        "n": 2 if i % 4 == 0 else 1,
    }
    chat = {"messages": [{"role": "user", "content": f"Describe person {i} and the weather."}], **common}
    tools = {**chat, "tools": [WEATHER_TOOL, CLOCK_TOOL]}
    kinds: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "person", "schema": PERSON}}}),
        ("/v1/completions", {"prompt": f"Person {i} as JSON:", **common, "structured_outputs": {"json": PERSON}}),
        ("/v1/completions", {"prompt": f"Code {i}:", **common, "guided_regex": "[A-Z]{3}-[0-9a-z ]{10,40}"}),
        ("/v1/chat/completions", {**tools, "tool_choice": "required"}),
        ("/v1/chat/completions", {**tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        ("/v1/chat/completions", {**tools, "tool_choice": "auto"}),
    ]  # fmt: skip
    return kinds[i % len(kinds)]


async def one_client(
    client: httpx.AsyncClient,
    live_server: LiveServer,
    rng: random.Random,
    i: int,
    stats: dict[str, int],
    make_body: Callable[[random.Random, int], tuple[str, dict[str, Any]]] = request_body,
) -> None:
    path, body = make_body(rng, i)
    mode = rng.choice(["before-headers", "after-events", "after-events", "after-events"])
    if mode == "before-headers":
        # NOTE: cancelling the task closes the connection wherever the request is (maybe not yet answered).
        task = asyncio.ensure_future(client.post(path, json=body, headers=live_server.headers))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        task.cancel()
        try:
            await task
            stats["completed-early"] += 1
        except asyncio.CancelledError:
            stats["cut-before-headers"] += 1
        return
    cut_after = rng.randint(0, MAX_TOKENS // 2)
    async with client.stream("POST", path, json=body, headers=live_server.headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        seen = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            assert '"error"' not in line, line
            if line == "data: [DONE]":
                stats["completed-early"] += 1  # the output ended before the cut
                return
            if seen >= cut_after:
                break
            seen += 1
    stats["cut-mid-stream" if seen else "cut-at-start"] += 1  # leaving the block closes the connection


async def storm(
    live_server: LiveServer,
    num_streams: int = NUM_STREAMS,
    make_body: Callable[[random.Random, int], tuple[str, dict[str, Any]]] = request_body,
) -> dict[str, int]:
    rng = random.Random(1234)
    stats: dict[str, int] = {
        k: 0 for k in ("cut-before-headers", "completed-early", "cut-at-start", "cut-mid-stream")
    }
    semaphore = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=live_server.base_url, timeout=60, limits=limits) as client:

        async def bounded(i: int) -> None:
            async with semaphore:
                await one_client(client, live_server, random.Random(rng.random()), i, stats, make_body)

        await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(num_streams))), STORM_TIMEOUT_S)
    return stats


def test_disconnect_storm_frees_every_block(live_server: LiveServer) -> None:
    assert live_server.wait_idle(timeout=30)
    stats = asyncio.run(storm(live_server))
    assert sum(stats.values()) == NUM_STREAMS, stats
    assert stats["cut-mid-stream"] >= NUM_STREAMS // 3, stats  # the storm really cut streams mid-way
    assert stats["cut-before-headers"] + stats["completed-early"] >= 5, stats
    assert_all_released(live_server)
    # The next request is served in full.
    resp = httpx.post(
        live_server.base_url + "/v1/completions",
        json={"prompt": "After the storm", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        headers=live_server.headers,
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 8


def num_grammar_matchers_alive() -> int:
    """``GrammarMatcher`` objects the process still holds (garbage collected first)."""
    gc.collect()
    return sum(type(o) is GrammarMatcher for o in gc.get_objects())  # NOTE: isinstance wakes lazy modules


def test_disconnect_storm_on_constrained_and_tool_streams(live_server: LiveServer) -> None:
    assert live_server.wait_idle(timeout=30)
    alive_before = num_grammar_matchers_alive()
    stats = asyncio.run(storm(live_server, NUM_CONSTRAINED_STREAMS, constrained_body))
    assert sum(stats.values()) == NUM_CONSTRAINED_STREAMS, stats
    assert stats["cut-mid-stream"] >= NUM_CONSTRAINED_STREAMS // 4, stats  # the storm really cut streams
    assert_all_released(live_server)  # blocks, requests, and num_grammar_matchers 0
    assert num_grammar_matchers_alive() <= alive_before
    # A constrained request after the storm is served, valid.
    resp = httpx.post(
        live_server.base_url + "/v1/chat/completions",
        json=constrained_body(random.Random(0), 0)[1] | {"stream": False, "n": 1},
        headers=live_server.headers,
        timeout=60,
    )
    assert resp.status_code == 200, resp.text


NUM_SPECULATIVE_STREAMS = 40


def speculative_body(rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    """A speculating stream: prompt lookup (the repeated dragon gives it n-grams) or early exit."""
    route, body = request_body(rng, i)
    return route, body | ({"prompt_lookup_num_tokens": 4} if i % 2 else {"assistant_early_exit": 20})


def test_disconnect_storm_on_speculating_streams(live_server: LiveServer) -> None:
    assert live_server.wait_idle(timeout=30)
    drafts_before = spec_drafts(live_server.base_url)
    stats = asyncio.run(storm(live_server, NUM_SPECULATIVE_STREAMS, speculative_body))
    assert sum(stats.values()) == NUM_SPECULATIVE_STREAMS, stats
    assert stats["cut-mid-stream"] >= NUM_SPECULATIVE_STREAMS // 4, stats
    assert spec_drafts(live_server.base_url) > drafts_before  # the streams really speculated
    assert_all_released(live_server)  # no block, no request left; the drafts' slots rolled back


NUM_CONTRASTIVE_STREAMS = 16


def contrastive_body(rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    """A contrastive-search stream: its top_k candidates are forks of the sequence in every step."""
    route, body = request_body(rng, i)
    return route, body | {"n": 1, "penalty_alpha": 0.6, "top_k": 4}


def test_disconnect_storm_on_contrastive_streams(live_server: LiveServer) -> None:
    """Cut at any point, a contrastive search leaves none of its candidate forks' blocks behind."""
    assert live_server.wait_idle(timeout=30)
    stats = asyncio.run(storm(live_server, NUM_CONTRASTIVE_STREAMS, contrastive_body))
    assert sum(stats.values()) == NUM_CONTRASTIVE_STREAMS, stats
    assert stats["cut-mid-stream"] >= NUM_CONTRASTIVE_STREAMS // 4, stats
    assert_all_released(live_server)


def spec_drafts(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "cbserve:spec_decode_num_drafts_total"
    )


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_clients_that_leave(live_server: LiveServer, route: str) -> None:
    """Several non-streaming requests (n = 2, a two-prompt one, and a beam search returning its 2 best of 3
    beams) whose clients give up long before the answer is ready: each is cancelled and its blocks freed."""
    assert live_server.wait_idle(timeout=30)
    long: dict[str, Any] = {"max_tokens": 300, "temperature": 0, "ignore_eos": True, "n": 2}
    beams = {**long, "use_beam_search": True, "best_of": 3}
    if route == "/v1/completions":
        bodies: list[dict[str, Any]] = [
            {"prompt": ["A tale of two cities", "A tale of three"], **long},
            {"prompt": "Another tale", **long},
            {"prompt": "A searched tale", **beams},
        ]
    else:
        bodies = [{"messages": [{"role": "user", "content": f"Tell story {k}"}], **long} for k in range(2)]
        bodies.append({"messages": [{"role": "user", "content": "Tell a searched story"}], **beams})

    num_prompts = sum(len(b["prompt"]) if isinstance(b.get("prompt"), list) else 1 for b in bodies)
    manager = live_server.state.manager
    assert manager is not None

    async def leave_early() -> int:
        async with httpx.AsyncClient(base_url=live_server.base_url, timeout=60) as client:
            calls = [
                asyncio.ensure_future(client.post(route, json=b, headers=live_server.headers)) for b in bodies
            ]
            # NOTE: the clients leave once the engine holds every request: a fixed client timeout raced a
            # loaded machine, where the server could admit them only after the check for idle.
            held = await asyncio.to_thread(wait_until, lambda: manager.num_unfinished() >= num_prompts, 60)
            for call in calls:
                call.cancel()
            results = await asyncio.gather(*calls, return_exceptions=True)
        assert held, manager.stats()
        return sum(isinstance(r, asyncio.CancelledError) for r in results)

    aborted_before = scrape(live_server.base_url)["abort"]
    assert asyncio.run(leave_early()) == len(bodies)
    assert_all_released(live_server)
    # Freed by the cancellation (every sample ends as an abort), not by running 300 tokens to the end.
    num_samples = num_prompts * 2
    assert scrape(live_server.base_url)["abort"] - aborted_before == num_samples
