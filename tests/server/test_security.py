"""Security defaults:

- with an API key set, every route but the open ones (/health, /metrics, /version, docs) answers 401 with
  the OpenAI error body unless ``Authorization: Bearer <key>`` is right, and the key is compared with
  ``hmac.compare_digest`` (constant time; asserted by spying on it);
- no prompt text (and no API key) in the log at the default level (a ``cbserve serve`` subprocess, its
  log grepped for a unique marker sent in prompts, chat messages, streams and failing requests);
- CORS is off unless configured: no ``access-control-allow-origin`` on a preflight by default; with
  ``--cors-origins`` only the listed origin gets it;
- the server binds 127.0.0.1 unless told otherwise (the CLI default, and the subprocess's listening
  socket as ``/proc/net/tcp`` shows it).
"""

from __future__ import annotations

import hmac
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import LiveServer, free_port, wait_until

from cli.main import build_parser

PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/anything", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/v1/watermark/detect", {"tokens": [5, 6, 7], "watermarking_config": {}}),
    ("GET", "/server_info", None),
    ("GET", "/model_info", None),
    ("GET", "/get_load", None),
]
OPEN = ["/health", "/metrics", "/version", "/openapi.json", "/docs"]
ALLOWED_ORIGIN = "http://allowed.example"
SUBPROCESS_API_KEY = "sk-subprocess-" + uuid.uuid4().hex
MARKER = "zq" + uuid.uuid4().hex[:12] + "xv"  # a string no log line could hold by chance


def assert_401(resp: httpx.Response) -> None:
    assert resp.status_code == 401, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
    assert resp.headers.get("www-authenticate") == "Bearer"


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_api_key_required(live_server: LiveServer, method: str, path: str, body: Any) -> None:
    url = live_server.base_url + path
    key = live_server.api_key
    for headers in (
        {},
        {"Authorization": "Bearer wrong-key"},
        {"Authorization": f"Bearer {key}x"},
        {"Authorization": f"Bearer {key[:-1]}"},
        {"Authorization": f"Basic {key}"},
        {"Authorization": key},
        {"Authorization": "Bearer"},
    ):
        assert_401(httpx.request(method, url, json=body, headers=headers, timeout=30))
    resp = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert resp.status_code in (200, 404), resp.text  # 404: /v1/models/anything is not the served model
    assert resp.status_code != 404 or resp.json()["error"]["code"] == "model_not_found"


def test_flushing_the_cache_needs_the_key(live_server: LiveServer) -> None:
    # NOTE: not flushed with the key here: the session's other tests share this server's prefix cache.
    assert_401(httpx.post(live_server.base_url + "/flush_cache", timeout=30))


@pytest.mark.parametrize("path", OPEN)
def test_open_routes_need_no_key(live_server: LiveServer, path: str) -> None:
    assert httpx.get(live_server.base_url + path, timeout=30).status_code == 200


def test_api_key_compared_in_constant_time(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, Any]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    # NOTE: server/middleware/auth.py calls hmac.compare_digest through the module, so patching the module is seen
    # by the in-process server thread.
    monkeypatch.setattr(hmac, "compare_digest", spy)
    url = live_server.base_url + "/v1/models"
    assert_401(httpx.get(url, headers={"Authorization": "Bearer not-the-key"}, timeout=30))
    assert httpx.get(url, headers=live_server.headers, timeout=30).status_code == 200
    key = live_server.api_key.encode()
    assert (b"not-the-key", key) in calls and (key, key) in calls, calls


# ---------------------------------------------------------------------------------- CORS (default: off)


def preflight(base: str, origin: str) -> httpx.Response:
    return httpx.options(
        base + "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=30,
    )


def test_cors_off_by_default(live_server: LiveServer) -> None:
    resp = preflight(live_server.base_url, ALLOWED_ORIGIN)
    assert "access-control-allow-origin" not in resp.headers, dict(resp.headers)
    resp = httpx.get(
        live_server.base_url + "/v1/models", headers={**live_server.headers, "Origin": ALLOWED_ORIGIN}
    )
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


def test_cli_binds_loopback_by_default() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"
    assert args.cors_origins is None and args.api_key is None


# ------------------------------------------------------------------- a `cbserve serve` subprocess


@dataclass
class Subprocess:
    base: str
    port: int
    log: Path
    proc: subprocess.Popen[bytes]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {SUBPROCESS_API_KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Subprocess]:
    """``cbserve serve`` with the defaults (log level, host) and ``--cors-origins``/``--api-key``."""
    port = free_port()
    log = tmp_path_factory.mktemp("security") / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CBSERVE_")}
    env["CBSERVE_API_KEY"] = SUBPROCESS_API_KEY  # NOTE: the environment, as a deployment passes secrets
    cmd = [
        str(Path(sys.executable).parent / "cbserve"), "serve", "--port", str(port), "--device", "cpu",
        "--num-blocks", "32", "--max-model-len", "256", "--cors-origins", ALLOWED_ORIGIN,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, env=env)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return proc.poll() is not None or httpx.get(base + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_until(up, 180, interval=0.5) and proc.poll() is None, log.read_text()
        yield Subprocess(base, port, log, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_no_prompt_text_or_key_in_default_logs(served: Subprocess) -> None:
    h = served.headers
    url = served.base
    prompt = f"Remember the code word {MARKER} and repeat it:"
    chat = {"messages": [{"role": "system", "content": MARKER}, {"role": "user", "content": prompt}]}
    requests: list[tuple[str, dict[str, Any], int]] = [
        ("/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0}, 200),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 6, "stream": True, "logprobs": 2}, 200),
        ("/v1/completions", {"prompt": [prompt, MARKER], "max_tokens": 3, "echo": True}, 200),
        ("/v1/chat/completions", {**chat, "max_tokens": 6}, 200),
        ("/v1/chat/completions", {**chat, "max_tokens": 6, "stream": True}, 200),
        ("/tokenize", {"prompt": prompt}, 200),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 10_000}, 400),  # context length exceeded
        ("/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": MARKER}, 400),
        ("/v1/chat/completions", {"messages": [{"role": MARKER, "content": MARKER}]}, 400),
        (
            "/v1/completions",
            {"prompt": prompt, "stop": MARKER, "max_tokens": 2, "unknown_field": MARKER},
            200,
        ),
    ]
    for path, body, status in requests:
        resp = httpx.post(url + path, json=body, headers=h, timeout=120)
        assert resp.status_code == status, (path, resp.text)
    assert_401(httpx.post(url + "/v1/completions", json={"prompt": MARKER}, timeout=30))
    text = served.log.read_text()
    assert "serving" in text and str(served.port) in text  # the log is captured (the start-up line)
    assert "unknown_field" in text  # and request-time warnings reach it too
    assert MARKER not in text, [line for line in text.splitlines() if MARKER in line]
    assert SUBPROCESS_API_KEY not in text


@pytest.mark.slow
def test_cors_only_for_configured_origins(served: Subprocess) -> None:
    resp = preflight(served.base, ALLOWED_ORIGIN)
    assert resp.status_code == 200, resp.text
    assert resp.headers.get("access-control-allow-origin") == ALLOWED_ORIGIN
    assert "POST" in resp.headers.get("access-control-allow-methods", "")
    resp = preflight(served.base, "http://evil.example")
    assert "access-control-allow-origin" not in resp.headers, dict(resp.headers)
    resp = httpx.get(
        served.base + "/v1/models", headers={**served.headers, "Origin": ALLOWED_ORIGIN}, timeout=30
    )
    assert resp.status_code == 200 and resp.headers.get("access-control-allow-origin") == ALLOWED_ORIGIN
    resp = httpx.get(served.base + "/v1/models", headers={**served.headers, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in resp.headers


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of sockets listening on ``port``."""
    found: list[str] = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(name):
            continue
        with open(name) as f:
            next(f)
            for line in f:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.append(address)
    return found


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net/tcp")
def test_subprocess_listens_on_loopback_only(served: Subprocess) -> None:
    # 0100007F is 127.0.0.1 in /proc's little-endian hex; 0.0.0.0 or :: would expose the server.
    assert wait_until(lambda: bool(listening_addresses(served.port)), 5)
    assert listening_addresses(served.port) == ["0100007F"]
