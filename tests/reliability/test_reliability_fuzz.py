"""Fuzzing with schemathesis against the server's own OpenAPI schema (``/openapi.json``): every operation,
with data that fits the schema (positive) and data that does not (negative). The server must never answer
5xx, every 4xx must carry the OpenAI error body, and a stream must never carry a server error event.

The structured-output and tool fields (``response_format``, ``structured_outputs``, ``guided_json``,
``guided_regex``, ``tools``, ``tool_choice``) must be in the published schema, and are fuzzed on their own
too: in a copy of the schema that requires one of them, so that every case carries it (a plain run may
leave optional fields out). Each case that reaches the engine compiles a grammar from fuzzed input.
So are the beam-search fields (``use_beam_search``, ``best_of``, ``num_beams``, ``length_penalty``,
``early_stopping``, ``num_beam_groups``, ``diversity_penalty``, ``force_words_ids``) and the speculative
ones (``prompt_lookup_num_tokens``, ``max_matching_ngram_size``, ``assistant_early_exit``,
``assistant_confidence_threshold``, ``num_assistant_tokens``, ``num_assistant_tokens_schedule``), in
groups that work together, each group required at once: a case with beams or drafts runs them.

Bounded: ``MAX_EXAMPLES`` cases per operation and mode (``MAX_FIELD_EXAMPLES`` per focused field), no
shrinking, and generation kept short by capping ``max_tokens``/``max_completion_tokens``/``n`` in each
case before it is sent (the cap keeps a valid case valid; a case made invalid by it is still a fair input).
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from server_fixtures import LiveServer

MAX_EXAMPLES = 25
MAX_FIELD_EXAMPLES = 12
MAX_NEW_TOKENS = 4
MAX_N = 3
MAX_PROMPTS = 4
CALL_TIMEOUT_S = 60.0
ERROR_KEYS = {"message", "type", "param", "code"}
# Every route the server documents; the fuzzer must reach each of them.
EXPECTED_OPERATIONS = {
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/watermark/detect"),
    ("GET", "/health"),
    ("GET", "/version"),
    ("GET", "/metrics"),
}
Focus = tuple[str, str, tuple[str, ...]]  # (path, request schema, fields every case carries)
# Each structured-output or tool field, fuzzed in every case.
FOCUSED_FIELDS: list[Focus] = [
    *[("/v1/completions", "CompletionRequest", (f,)) for f in ("response_format", "structured_outputs",
                                                                "guided_json", "guided_regex")],
    *[("/v1/chat/completions", "ChatCompletionRequest", (f,)) for f in ("response_format", "structured_outputs",
                                                                         "tools", "tool_choice")],
]  # fmt: skip
# The beam-search and speculative fields, in groups required together.
FOCUSED_GROUPS: list[Focus] = [
    ("/v1/completions", "CompletionRequest", ("use_beam_search", "best_of", "length_penalty", "early_stopping")),
    ("/v1/chat/completions", "ChatCompletionRequest", ("num_beams", "num_beam_groups", "diversity_penalty")),
    ("/v1/completions", "CompletionRequest", ("num_beams", "force_words_ids")),
    ("/v1/completions", "CompletionRequest", ("prompt_lookup_num_tokens", "max_matching_ngram_size")),
    ("/v1/chat/completions", "ChatCompletionRequest", ("assistant_early_exit", "assistant_confidence_threshold")),
    ("/v1/chat/completions", "ChatCompletionRequest", ("num_assistant_tokens", "num_assistant_tokens_schedule")),
]  # fmt: skip


def cap_generation(body: Any) -> None:
    """Keep a generation request short: cap token budgets, ``n`` and the number of prompts in place."""
    if not isinstance(body, dict):
        return

    def number(value: Any) -> bool:  # NOTE: JSON 25.0 is a valid int to pydantic, so floats count too
        return isinstance(value, int | float) and not isinstance(value, bool)

    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key, 0)
        if value is None or (number(value) and value > MAX_NEW_TOKENS):
            body[key] = MAX_NEW_TOKENS  # null means the default: the whole context left
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        # NOTE: chat's default is the whole context left; a fuzz case must not generate that long.
        body["max_tokens"] = MAX_NEW_TOKENS
    n = body.get("n")
    if number(n) and n > MAX_N:
        body["n"] = MAX_N
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        body["prompt"] = prompt[:MAX_PROMPTS]


def content_type(resp: Any) -> str:
    """The response's content type (schemathesis' responses hold each header as a list)."""
    value = resp.headers.get("content-type") or resp.headers.get("Content-Type") or ""
    return str(value[0] if isinstance(value, list) and value else value)


def problems_of(resp: Any) -> list[str]:
    """What is wrong with one response (empty when it is acceptable)."""
    status = resp.status_code
    if status >= 500:
        return [f"server error {status}: {resp.text[:300]}"]
    if 400 <= status < 500:
        try:
            body = resp.json()
        except ValueError:
            return [f"{status} without a JSON body: {resp.text[:300]!r}"]
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict) or set(error) != ERROR_KEYS or set(body) != {"error"}:
            return [f"{status} without the OpenAI error body: {body!r}"]
        if not isinstance(error["message"], str) or not error["message"]:
            return [f"{status} with an empty message: {body!r}"]
        return []
    if content_type(resp).startswith("text/event-stream"):
        for line in resp.text.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return [f"stream error event: {event['error']!r}"]
    return []


def describe(case: Any) -> str:
    return f"{case.method} {case.formatted_path} query={case.query!r} body={case.body!r}"[:600]


def fuzz_operation(
    operation: Any,
    mode: GenerationMode,
    live_server: LiveServer,
    session: requests.Session,
    max_examples: int = MAX_EXAMPLES,
) -> tuple[int, list[str]]:
    """Run up to ``max_examples`` cases of one operation; the number of calls made and the problems."""
    failures: list[str] = []
    num_calls = 0

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,  # NOTE: the same cases every run: a failure here reproduces
        phases=[Phase.explicit, Phase.generate],  # no shrinking: each case costs a request
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        nonlocal num_calls
        cap_generation(case.body)
        resp = case.call(
            base_url=live_server.base_url,
            session=session,
            headers=live_server.headers,
            timeout=CALL_TIMEOUT_S,
        )
        num_calls += 1
        failures.extend(f"{describe(case)}: {p}" for p in problems_of(resp))

    try:
        run()
    except Unsatisfiable:
        pass  # NOTE: no negative case exists for an operation without inputs (GET /health)
    return num_calls, failures


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_fuzz_every_operation(live_server: LiveServer, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(live_server.base_url + "/openapi.json", timeout=30)
    operations: list[Any] = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    found = {(op.method.upper(), op.path) for op in operations}
    assert EXPECTED_OPERATIONS <= found, (
        f"operations missing from /openapi.json: {EXPECTED_OPERATIONS - found}"
    )

    failures: list[str] = []
    calls: dict[str, int] = {}
    started = time.monotonic()
    with requests.Session() as session:
        for operation in operations:
            label = f"{operation.method.upper()} {operation.path}"
            calls[label], problems = fuzz_operation(operation, mode, live_server, session)
            failures.extend(problems)
    assert not failures, "\n".join(failures[:20])
    generation_routes = ("POST /v1/completions", "POST /v1/chat/completions")
    assert all(calls[r] >= MAX_EXAMPLES // 2 for r in generation_routes), calls
    # The server is still healthy and idle after the run.
    assert requests.get(live_server.base_url + "/health", timeout=10).status_code == 200
    assert live_server.wait_idle(timeout=60), live_server.state.manager and live_server.state.manager.stats()
    assert time.monotonic() - started < 300


def requiring(raw: dict[str, Any], component: str, *fields: str) -> dict[str, Any]:
    """A copy of the OpenAPI document whose ``component`` request schema requires ``fields``."""
    changed = copy.deepcopy(raw)
    schema = changed["components"]["schemas"][component]
    for field in fields:
        assert field in schema["properties"], f"{field} is missing from the published {component}"
    schema["required"] = [*schema.get("required", []), *fields]
    return changed


def fuzz_focused(live_server: LiveServer, mode: GenerationMode, focused: list[Focus]) -> None:
    """``MAX_FIELD_EXAMPLES`` cases of each focus (its fields required): the checks of every fuzz case, then
    the server healthy and idle."""
    raw = requests.get(live_server.base_url + "/openapi.json", timeout=30).json()
    failures: list[str] = []
    calls: dict[str, int] = {}
    with requests.Session() as session:
        for path, component, fields in focused:
            schema = schemathesis.openapi.from_dict(requiring(raw, component, *fields))
            operation = schema[path]["POST"]
            calls[f"{path} {'+'.join(fields)}"], problems = fuzz_operation(
                operation, mode, live_server, session, MAX_FIELD_EXAMPLES
            )
            failures.extend(problems)
    assert not failures, "\n".join(failures[:20])
    assert all(n >= MAX_FIELD_EXAMPLES // 2 for n in calls.values()), calls
    assert requests.get(live_server.base_url + "/health", timeout=10).status_code == 200
    assert live_server.wait_idle(timeout=60), live_server.state.manager and live_server.state.manager.stats()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_fuzz_structured_output_and_tool_fields(live_server: LiveServer, mode: GenerationMode) -> None:
    fuzz_focused(live_server, mode, FOCUSED_FIELDS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_fuzz_beam_search_and_speculative_fields(live_server: LiveServer, mode: GenerationMode) -> None:
    fuzz_focused(live_server, mode, FOCUSED_GROUPS)
