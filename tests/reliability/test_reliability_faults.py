"""Fault injection on the live server's manager, through a ``FaultyExecutor`` wrapping its executor:

- a forward raising once: exactly the requests of that step fail (a streaming client gets an error
  event then ``[DONE]``, a non-streaming one a 500 body), every other request completes, and the server
  keeps serving;
- one request's logits row edited to NaN: that request alone fails, while the request
  sharing its batch completes normally.

Requests are told apart in the engine by their ``X-Request-Id``, which prefixes the engine's request ids.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from executor_faults import FaultyExecutor
from server_fixtures import LiveServer, wait_until

from engine.manager import ContinuousBatchingManager
from scheduler.batch import ScheduledBatch

MAX_TOKENS = 30


@pytest.fixture
def manager(live_server: LiveServer) -> Iterator[ContinuousBatchingManager]:
    assert live_server.wait_idle(timeout=30)
    manager = live_server.state.manager
    assert manager is not None
    executor = manager.executor
    try:
        yield manager
    finally:
        manager.executor = executor
    assert live_server.wait_idle(timeout=30), manager.stats()
    manager.check_integrity()
    # The server keeps serving after the fault.
    resp = httpx.post(
        live_server.base_url + "/v1/completions",
        json={"prompt": "Still here?", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        headers=live_server.headers,
        timeout=60,
    )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4, resp.text


def owner(engine_request_id: str, client_ids: list[str]) -> str | None:
    """The client (X-Request-Id) whose request an engine (scheduler) request id belongs to."""
    for cid in client_ids:
        if engine_request_id.startswith(cid + "-"):
            return cid
    return None


class Client(threading.Thread):
    """One HTTP request in a thread; ``outcome`` is ``"ok"`` (complete, ``MAX_TOKENS`` tokens) or the
    error body's ``code`` (streams: the error event's)."""

    def __init__(
        self, live_server: LiveServer, client_id: str, stream: bool, started: threading.Event
    ) -> None:
        super().__init__(name=client_id, daemon=True)
        self.live_server = live_server
        self.client_id = client_id
        self.stream = stream
        self.started = started
        self.outcome: str | None = None
        self.detail: Any = None

    def run(self) -> None:
        body = {
            "prompt": f"{self.client_id}: the story begins",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": self.stream,
        }
        headers = {**self.live_server.headers, "X-Request-Id": self.client_id}
        url = self.live_server.base_url + "/v1/completions"
        if not self.stream:
            self.started.set()
            resp = httpx.post(url, json=body, headers=headers, timeout=120)
            self.detail = resp.json()
            if resp.status_code == 200:
                ok = self.detail["usage"]["completion_tokens"] == MAX_TOKENS
                self.outcome = "ok" if ok else "short"
            else:
                self.outcome = f"{resp.status_code}:{self.detail['error']['code']}"
            return
        events: list[Any] = []
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    self.started.set()
        self.detail = events
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        if events[-1] != "[DONE]":
            self.outcome = "no-done"
        elif errors:
            self.outcome = f"stream:{errors[0]['error']['code']}"
        else:
            finish = [
                e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]
            ]
            self.outcome = "ok" if finish == ["length"] else f"finish:{finish}"


def test_forward_raising_once_fails_only_that_steps_requests(
    live_server: LiveServer, manager: ContinuousBatchingManager
) -> None:
    first_wave = ["fault-a", "fault-b", "fault-c"]
    failed_step: list[str] = []
    victim_steps = 0
    lock = threading.Lock()

    def raise_once(batch: ScheduledBatch) -> None:
        nonlocal victim_steps
        ids = [s.request.request_id for s in batch.requests]
        with lock:
            if failed_step or not any(owner(i, ["fault-a"]) for i in ids):
                return
            victim_steps += 1
            if victim_steps < 3:  # NOTE: let the victim's stream start before it fails
                return
            failed_step.extend(ids)
        raise RuntimeError("injected forward failure")

    manager.executor = FaultyExecutor(manager.executor, before=raise_once)
    started = [threading.Event() for _ in first_wave]
    clients = [
        Client(live_server, cid, stream=cid != "fault-b", started=ev)
        for cid, ev in zip(first_wave, started, strict=True)
    ]
    for c in clients:
        c.start()
    assert wait_until(lambda: bool(failed_step), 60), "the fault never fired"
    # A request that arrives after the fault is served normally.
    late = Client(live_server, "fault-late", stream=True, started=threading.Event())
    late.start()
    for c in [*clients, late]:
        c.join(120)
        assert not c.is_alive(), c.client_id

    in_failed = {owner(i, first_wave) for i in failed_step} - {None}
    assert "fault-a" in in_failed
    for c in clients:
        if c.client_id in in_failed:
            expected = "stream:generation_failed" if c.stream else "500:generation_failed"
            assert c.outcome == expected, (c.client_id, c.outcome, c.detail)
        else:
            assert c.outcome == "ok", (c.client_id, c.outcome, c.detail)
    assert late.outcome == "ok", late.detail
    # The error names the failure without leaking a traceback.
    victim = next(c for c in clients if c.client_id == "fault-a")
    error = next(e for e in victim.detail if isinstance(e, dict) and "error" in e)["error"]
    assert "injected forward failure" in error["message"] and "Traceback" not in error["message"]


@pytest.mark.parametrize("victim_streams", [False, True], ids=["victim-non-streaming", "victim-streaming"])
def test_nan_logits_row_fails_that_request_alone(
    live_server: LiveServer, manager: ContinuousBatchingManager, victim_streams: bool
) -> None:
    ids = ["nan-victim", "nan-other"]
    fired: list[list[str]] = []

    def nan_row(batch: ScheduledBatch, logits: torch.Tensor) -> torch.Tensor:
        rows = [owner(s.request.request_id, ids) for s in batch.requests if s.needs_sample]
        if fired or "nan-victim" not in rows or "nan-other" not in rows or len(rows) != logits.shape[0]:
            return logits
        fired.append([str(r) for r in rows])
        logits = logits.clone()  # [num_logits, vocab]
        logits[rows.index("nan-victim")] = float("nan")
        return logits

    manager.executor = FaultyExecutor(manager.executor, edit=nan_row)
    victim = Client(live_server, "nan-victim", stream=victim_streams, started=threading.Event())
    other = Client(live_server, "nan-other", stream=True, started=threading.Event())
    victim.start()
    other.start()
    for c in (victim, other):
        c.join(120)
        assert not c.is_alive(), c.client_id
    assert fired, "the victim and the other request never shared a batch"
    expected = "stream:generation_failed" if victim_streams else "500:generation_failed"
    assert victim.outcome == expected, victim.detail
    assert other.outcome == "ok", other.detail
    error = (
        next(e for e in victim.detail if isinstance(e, dict) and "error" in e)["error"]
        if victim_streams
        else victim.detail["error"]
    )
    assert "nan" in error["message"].lower(), error
