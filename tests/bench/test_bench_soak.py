"""bench/soak.py with its constrained scenarios (bench/soak_constrained.py): how answers are checked (no
server), and a short bounded soak against the live server of the constrained mix, n = 2, beam searches and
prompt lookup on repeated text (cancelled or not): no failed accepted request, every block and grammar
matcher released after, and the lookups' drafts accepted."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from server_fixtures import MAX_MODEL_LEN, LiveServer

from bench import soak
from bench.soak_constrained import (
    CODE_REGEX,
    CONSTRAINED_SCENARIOS,
    check_answer,
    check_stream,
    constrained_request,
)

SOAK_SECONDS = 20  # a short run: the 10-minute soak is run by hand (docs/RELIABILITY.md)


def chunk(delta: dict[str, object], finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_a_streamed_tool_call_is_reassembled_and_its_arguments_checked() -> None:
    _, body = constrained_request(random.Random(0), "tool-call-stream")
    opening = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": ""}}
    good = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [opening]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1, "b": 2}'}}]}),
        chunk({}, "tool_calls"),
    ]
    assert check_stream(body, good) is None
    wrong = [*good[:2], chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}), good[3]]
    assert "invalid arguments for add" in str(check_stream(body, wrong))
    assert "expected tool_calls" in str(check_stream(body, [good[0], chunk({"content": "hi"}, "stop")]))


def test_beam_and_lookup_requests_fit_what_the_api_allows() -> None:
    rng = random.Random(0)
    for _ in range(20):
        path, body = soak.build_request(rng, "beam-search", MAX_MODEL_LEN)
        assert body["use_beam_search"] and not body.get("stream")
        assert 1 <= body["n"] <= body["best_of"] <= 4 and ("prompt" in body) == (path == "/v1/completions")
    _, body = soak.build_request(rng, "lookup-stream", MAX_MODEL_LEN)
    words = body["prompt"].split()
    phrase = words[: words.index(next(w for w in words if w.endswith("."))) + 1]
    assert body["prompt"].startswith(" ".join(phrase * 3)) and body["prompt_lookup_num_tokens"] > 0


def test_a_beam_answer_needs_n_choices_of_max_tokens_each() -> None:
    body = {"ignore_eos": True, "use_beam_search": True, "best_of": 3, "n": 2, "max_tokens": 8}
    choice = {"text": "x", "finish_reason": "length"}
    assert soak.check_json_answer(body, {"choices": [choice] * 2, "usage": {"completion_tokens": 16}}) is None
    assert "1 choices" in str(
        soak.check_json_answer(body, {"choices": [choice], "usage": {"completion_tokens": 16}})
    )
    short = {"choices": [choice] * 2, "usage": {"completion_tokens": 12}}
    assert "completion_tokens 12 != 16" in str(soak.check_json_answer(body, short))


def test_json_and_regex_answers_must_match_their_constraint() -> None:
    _, schema_body = constrained_request(random.Random(0), "json-schema-stream")
    person = '{"name": "Ann", "age": 30, "city": "Oslo"}'
    assert (
        check_stream(schema_body, [chunk({"content": person[:10]}), chunk({"content": person[10:]}, "stop")])
        is None
    )
    assert "invalid" in str(check_stream(schema_body, [chunk({"content": '{"name": "Ann"}'}, "stop")]))
    _, regex_body = constrained_request(random.Random(0), "regex")
    assert regex_body["guided_regex"] == CODE_REGEX
    answer = {"choices": [{"text": "ABC-1234", "finish_reason": "stop"}]}
    assert check_answer(regex_body, answer) is None
    answer = {"choices": [{"text": "ABC-12", "finish_reason": "length"}]}
    assert "expected stop" in str(check_answer(regex_body, answer))


@pytest.mark.slow
def test_a_short_soak_of_the_whole_mix_is_clean(live_server: LiveServer, tmp_path: Path) -> None:
    assert live_server.wait_idle(timeout=30)
    beams_and_lookups = ["beam-search", "cancel-beam-search", "lookup-stream", "cancel-lookup-stream"]
    scenarios = [*CONSTRAINED_SCENARIOS, "chat-n2", *beams_and_lookups]
    output = tmp_path / "soak.json"
    # NOTE: seed 9's workers begin with a tool-call stream, a lookup stream, a beam search and a tool call
    argv = ["--base-url", live_server.base_url, "--api-key", str(live_server.api_key), "--seed", "9"]
    argv += ["--duration", str(SOAK_SECONDS), "--concurrency", "4", "--scenarios", ",".join(scenarios)]
    manager = live_server.state.manager
    assert manager is not None
    speculator = manager.loop.speculator
    drafting_limit = speculator.disable_by_batch_size
    # NOTE: the live server drafts only while at most 4 sequences run; four beams beside a lookup run more
    speculator.disable_by_batch_size = 16
    try:
        status = soak.main([*argv, "--output", str(output)])
    finally:
        speculator.disable_by_batch_size = drafting_limit
    summary = json.loads(output.read_text())
    assert status == 0, summary
    assert summary["failed"] == 0 and summary["failures"] == [], summary
    assert not summary["leaked_blocks"] and summary["idle_gauges"]["cbserve:num_grammar_matchers"] == 0
    assert set(summary["by_scenario"]) <= set(scenarios)
    assert sum(summary["by_scenario"].get(s, 0) for s in CONSTRAINED_SCENARIOS) > 0, summary
    assert summary["by_scenario"].get("beam-search", 0) > 0 and summary["by_scenario"].get("lookup-stream"), (
        summary
    )
    assert summary["speculation"]["accepted_tokens"] > 0, summary
