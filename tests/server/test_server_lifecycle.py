"""Lifecycle: a client that leaves (streaming or not) frees its KV blocks; `cbserve serve` started from the
command line answers /health, and on SIGTERM drains (503 for new requests, the request in flight
completes) and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import LiveServer, free_port, wait_until


def _long_request(stream: bool) -> dict[str, Any]:
    return {
        "prompt": "Tell me a story.",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def test_stream_disconnect_frees_every_block(live_server: LiveServer) -> None:
    assert live_server.wait_idle()
    manager = live_server.state.manager
    assert manager is not None
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST",
            live_server.base_url + "/v1/completions",
            json=_long_request(True),
            headers=live_server.headers,
        ) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break  # generation is under way
            assert manager.stats().kv_cache_usage > 0
        # leaving the block closes the connection mid-stream
    assert live_server.wait_idle(timeout=30), manager.stats()
    assert wait_until(lambda: live_server.state.num_active == 0, 10)


def test_non_streaming_disconnect_cancels(live_server: LiveServer) -> None:
    assert live_server.wait_idle()
    manager = live_server.state.manager
    assert manager is not None
    with pytest.raises(httpx.ReadTimeout):
        # The client gives up after 1.5 s, long before 200 tokens are made, and drops the connection.
        httpx.post(
            live_server.base_url + "/v1/completions",
            json=_long_request(False),
            headers=live_server.headers,
            timeout=1.5,
        )
    assert live_server.wait_idle(timeout=30), manager.stats()
    assert wait_until(lambda: live_server.state.num_active == 0, 10)


def _wait_health(base: str, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    def ok() -> bool:
        if proc.poll() is not None:
            return True
        try:
            return httpx.get(base + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    return wait_until(ok, timeout, interval=0.5) and proc.poll() is None


@pytest.mark.slow
def test_cli_serve_health_and_sigterm_drain(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "CBSERVE_PORT": "1",  # the command line's --port wins over the environment
        "CBSERVE_DEVICE": "cpu",
        "CBSERVE_NUM_BLOCKS": "32",
        "CBSERVE_MAX_MODEL_LEN": "256",
        "CBSERVE_SERVED_MODEL_NAME": "cli-model",
        "CBSERVE_SHUTDOWN_TIMEOUT": "60",
    }
    env.pop("CBSERVE_API_KEY", None)
    log = tmp_path / "server.log"
    cbserve = Path(sys.executable).parent / "cbserve"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(cbserve), "serve", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=out,
            env=env,
        )
    try:
        assert _wait_health(base, proc, 180), log.read_text()
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == "cli-model"
        startup = log.read_text()
        assert "KV cache 32 blocks" in startup and f"http://127.0.0.1:{port}" in startup

        events: list[Any] = []
        first_delta = threading.Event()

        def stream() -> None:
            body = {
                "prompt": "Once upon a time",
                "max_tokens": 40,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        first_delta.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first_delta.wait(60), log.read_text()
        proc.send_signal(signal.SIGTERM)
        # Draining: still listening, but admitting nothing.
        assert wait_until(lambda: httpx.get(base + "/health", timeout=5).status_code == 503, 10)
        resp = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "server_draining"
        client.join(120)
        assert not client.is_alive()
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if isinstance(e, dict)]
        assert all("error" not in c for c in chunks), chunks
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == [
            "length"
        ]
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
