"""bench/structured_outputs.py: the workload it sends and how it classes answers (no server needed)."""

from __future__ import annotations

import json

import httpx

from bench.structured_outputs import (
    SCHEMAS,
    _classify,
    mix_requests,
    mix_schema,
    summarize_validity,
    validity_requests,
)


def _response(finish: str, content: str | None = None, tool_calls: list | None = None) -> httpx.Response:
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    body = {"choices": [{"finish_reason": finish, "message": message}], "usage": {"completion_tokens": 7}}
    return httpx.Response(200, json=body)


def test_the_validity_workload_is_48_schema_requests_and_12_tool_calls() -> None:
    requests = validity_requests("m", 256)
    kinds = [k for k, _ in requests]
    assert sum(k.startswith("json_schema:") for k in kinds) == 48
    assert sum(k.startswith("tool:") for k in kinds) == 12
    assert len({json.dumps(b, sort_keys=True) for _, b in requests}) == len(requests)  # seeded, all distinct


def test_answers_are_classed_valid_cut_invalid_or_error() -> None:
    kind, body = validity_requests("m", 256)[0]
    schema = body["response_format"]["json_schema"]["schema"]
    good = {"name": "A", "age": 3, "email": "a@b", "hobbies": []} if "email" in schema["properties"] else None
    assert good is not None
    assert _classify(kind, body, _response("stop", json.dumps(good)), 1.0).status == "valid"
    assert _classify(kind, body, _response("stop", '{"name": "A"}'), 1.0).status == "invalid"
    assert _classify(kind, body, _response("length", '{"name": "AAAA'), 1.0).status == "cut"
    assert _classify(kind, body, httpx.Response(400, json={"error": {}}), 1.0).status == "error"
    tool_kind, tool_body = validity_requests("m", 256)[48]
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": 1}'}}
    assert _classify(tool_kind, tool_body, _response("tool_calls", None, [call]), 1.0).status == "invalid"
    call["function"]["arguments"] = '{"city": "Oslo", "unit": "celsius"}'
    outcome = _classify(tool_kind, tool_body, _response("tool_calls", None, [call]), 1.0)
    assert outcome.status == "valid"
    summary = summarize_validity([outcome], 2.0)
    assert summary["tool_calls"] == {"valid": 1, "cut": 0, "invalid": 0, "error": 0}
    assert summary["output_tok_s"] == 3.5


def test_the_mix_constrains_every_other_request_with_a_schema_that_cannot_close_in_time() -> None:
    bodies = mix_requests("m", 8, 64, constrained=True, seed=0)
    constrained = [b for b in bodies if "response_format" in b]
    assert len(constrained) == 4 and all("ignore_eos" in b for b in bodies if b not in constrained)
    assert mix_schema(64)["properties"]["items"]["minItems"] == 64  # 64 strings need more than 64 tokens
    assert all("response_format" not in b for b in mix_requests("m", 8, 64, constrained=False, seed=0))
    assert set(SCHEMAS) == {"person", "product", "event", "measurement"}
