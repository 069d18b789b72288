"""Tensor parallelism behind the HTTP server (CPU, gloo, two ranks of the tiny random Llama): greedy
completions equal one process's; a killed rank fails the stream in flight, turns /health 503, and
`cbserve serve` exits 1 so that it is restarted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from server_fixtures import free_port, serve_in_thread, wait_until

from engine.engine import Engine
from engine.loader.model_loader import load_tokenizer
from engine.model_config import ModelConfig
from server.app import build_app
from server.config import ServerConfig

pytestmark = pytest.mark.slow  # spawns processes; the default model's tokenizer

PROMPT = (  # over two KV blocks of 16 tokens: a prompt sent again finds them cached
    "The tide comes in, the tide goes out, and on the long grey pier above the fishing boats, where the "
    "nets dry in the wind and the old harbour master counts the days, the gulls"
)
CACHE = {"num_blocks": 12, "max_model_len": 256}  # the four concurrent requests need 20: preemption
ENDINGS = (" cry", " sleep", " circle the harbour", " quarrel over bread")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory, tiny_model_config: ModelConfig) -> Path:
    folder = tmp_path_factory.mktemp("tiny-tp-http")
    (folder / "config.json").write_text(json.dumps(tiny_model_config.replace(vocab_size=50001).to_hf_dict()))
    load_tokenizer("default").save(folder)
    return folder


def _engine(folder: Path, tensor_parallel_size: int) -> Engine:
    return Engine.from_pretrained(
        str(folder), load_format="dummy", device="cpu", tensor_parallel_size=tensor_parallel_size, **CACHE
    )


def _greedy_completion(base: str, ids: list[int]) -> dict[str, Any]:
    body = {"prompt": ids, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    resp = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    choice: dict[str, Any] = resp.json()["choices"][0]
    return choice


def _workload(base: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """The prompts at once (more than the cache holds), then each again one after another (prefix hits)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda ids: _greedy_completion(base, ids), prompts))
    return together + [_greedy_completion(base, ids) for ids in prompts]


def _assert_same(expected: list[dict[str, Any]], got: list[dict[str, Any]]) -> None:
    for a, b in zip(expected, got, strict=True):
        assert b["text"] == a["text"]
        want, have = a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]
        assert max(abs(x - y) for x, y in zip(want, have, strict=True)) < 1e-4


def _stream_events(base: str, ids: list[int], events: list[Any], first: threading.Event) -> None:
    body = {"prompt": ids, "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                first.set()


def _kill_a_rank(pid: int) -> None:
    """SIGKILL rank 1: the spawned child of ``pid`` (not multiprocessing's resource tracker)."""
    ranks = [
        p
        for p in psutil.Process(pid).children()
        if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert len(ranks) == 1, ranks
    os.kill(ranks[0].pid, signal.SIGKILL)


def test_http_through_two_ranks(tiny_folder: Path) -> None:
    one, two = _engine(tiny_folder, 1), _engine(tiny_folder, 2)
    prompts = [one.tokenizer.encode(PROMPT + ending) for ending in ENDINGS]
    ids = prompts[0]
    try:
        with serve_in_thread(build_app(one, ServerConfig(served_model_name="tiny")), "tp1") as base:
            expected = _workload(base, prompts)
        app = build_app(two, ServerConfig(served_model_name="tiny"))
        with serve_in_thread(app, "tp2") as base:
            _assert_same(expected, _workload(base, prompts))
            stats = app.state.server.manager.stats()
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0

            events: list[Any] = []
            first = threading.Event()
            client = threading.Thread(target=_stream_events, args=(base, ids, events, first))
            client.start()
            assert first.wait(60)
            _kill_a_rank(os.getpid())
            client.join(60)
            assert not client.is_alive()
            errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
            assert errors and "tensor parallelism failed" in errors[0]["message"], events
            health = httpx.get(base + "/health", timeout=10)
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            assert app.state.server.manager.executor_failure is not None
    finally:
        two.close()


def test_cli_exits_1_when_a_rank_dies(tiny_folder: Path, tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    argv = [sys.executable, "-m", "cli.main", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--model", str(tiny_folder), "--load-format", "dummy", "--device", "cpu", "-tp", "2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CBSERVE_")}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, env=env, cwd=Path(__file__).parents[2])
    try:

        def healthy() -> bool:
            try:
                return proc.poll() is None and httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        # healthy once (a second look could time out on a loaded machine), or the process ended
        assert wait_until(lambda: healthy() or proc.poll() is not None, 180, 0.5) and proc.poll() is None, (
            log.read_text()
        )
        _kill_a_rank(proc.pid)
        assert proc.wait(60) == 1, log.read_text()
        assert "tensor parallelism failed: rank 1's process exited" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
