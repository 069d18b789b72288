"""Requests that reach the engine together start together (``arrival_window_ms``, engine/loop.py's
``_gather_arrivals``): at an idle engine a burst whose last requests come a little later is still
prefilled in one step, and a lone request waits one window for company; beside running requests arrivals
start at once. Observed through the manager's step observer: a step's token count
says which prompts it prefilled."""

from __future__ import annotations

import threading
import time

import pytest
from default_engine import engine_on

from engine.loader.model_loader import LoadedModel

pytestmark = pytest.mark.slow  # the real model, float32

PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13, 14, 15]]


def first_step_tokens(loaded: LoadedModel, window_ms: float, early: int, late_after_s: float) -> int:
    """The first step's token count when ``early`` prompts reach the idle engine together (the engine
    thread held in its idle wait until all are in its inbox: then one drain admits them) and the next one
    comes ``late_after_s`` later."""
    manager = engine_on(loaded, arrival_window_ms=window_ms).init_continuous_batching()
    steps: list[int] = []
    manager.add_step_observer(steps.append)
    inbox = manager.loop.inbox
    idle, gate, real_wait = threading.Event(), threading.Event(), inbox.wait

    def held_wait(timeout: float) -> None:
        idle.set()
        gate.wait(30)
        real_wait(timeout)

    inbox.wait = held_wait  # type: ignore[method-assign]
    timer = threading.Timer(late_after_s, lambda: manager.add_request(PROMPTS[early], max_new_tokens=2))
    manager.start()
    try:
        assert idle.wait(30), "the engine never went idle"
        for ids in PROMPTS[:early]:
            manager.add_request(ids, max_new_tokens=2)
        gate.set()
        timer.start()
        deadline = time.monotonic() + 60
        while sum(steps) < sum(len(p) for p in PROMPTS[: early + 1]) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gate.set()
        if timer.is_alive():
            timer.join()
        manager.stop(True, 30)
    assert steps, "the engine ran no step"
    return steps[0]


def test_a_burst_that_comes_in_two_parts_is_prefilled_in_one_step(default_model: LoadedModel) -> None:
    """Two requests come at once as the engine idles, the third 20 ms later, inside the window."""
    assert first_step_tokens(default_model, 200.0, early=2, late_after_s=0.02) == sum(map(len, PROMPTS))


def test_without_the_window_the_engine_starts_on_what_it_has(default_model: LoadedModel) -> None:
    first = first_step_tokens(default_model, 0.0, early=2, late_after_s=0.5)
    assert first == len(PROMPTS[0]) + len(PROMPTS[1])


def test_a_lone_request_waits_one_window_for_company(default_model: LoadedModel) -> None:
    """A burst's first request often reaches the idle engine alone: one that comes 20 ms later, inside
    the window, is prefilled in the same step."""
    assert first_step_tokens(default_model, 200.0, early=1, late_after_s=0.02) == len(PROMPTS[0]) + len(
        PROMPTS[1]
    )


def test_a_lone_request_waits_no_longer_than_one_window(default_model: LoadedModel) -> None:
    """One request at an idle engine that nothing follows within the window starts alone: a second one
    0.5 s later, past a 0.1 s window, is not in the first step."""
    assert first_step_tokens(default_model, 100.0, early=1, late_after_s=0.5) == len(PROMPTS[0])


def steps_beside_a_running_request(
    loaded: LoadedModel, window_ms: float, early: int, late_after_s: float
) -> list[int]:
    """Every step's token count when, after a running request's third step, ``early`` prompts reach the
    engine together (put in its inbox by that step's observer: the next drain admits them) and the next one
    comes ``late_after_s`` later."""
    manager = engine_on(loaded, arrival_window_ms=window_ms).init_continuous_batching()
    steps: list[int] = []
    timer = threading.Timer(late_after_s, lambda: manager.add_request(PROMPTS[early], max_new_tokens=2))

    def observe(num_tokens: int) -> None:
        steps.append(num_tokens)
        if len(steps) == 3:
            for ids in PROMPTS[:early]:
                manager.add_request(ids, max_new_tokens=2)
            timer.start()

    manager.add_step_observer(observe)
    manager.start()
    try:
        manager.add_request([20, 21, 22], max_new_tokens=40)
        deadline = time.monotonic() + 60
        while sum(steps) < 3 + 40 + sum(len(p) for p in PROMPTS[: early + 1]) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        if timer.is_alive():
            timer.join()
        manager.stop(True, 30)
    return steps


@pytest.mark.parametrize("early", [1, 2])
def test_arrivals_beside_running_requests_do_not_wait(default_model: LoadedModel, early: int) -> None:
    """Requests that come while another decodes: the next step prefills them at once, without the one that
    comes 0.3 s later, although a 1 s window would have taken it at an idle engine."""
    steps = steps_beside_a_running_request(default_model, 1000.0, early=early, late_after_s=0.3)
    assert steps[3] == 1 + sum(len(p) for p in PROMPTS[:early]), steps
