"""Structured outputs against any OpenAI-compatible server (cbserve, vLLM, ...): are they valid, do they end?

    python -m bench.structured_outputs validity --base-url http://127.0.0.1:8000 --save-result so.json
    python -m bench.structured_outputs mix --base-url http://127.0.0.1:8000 --rounds 3

``validity`` sends the same 48 JSON-schema chat requests (4 schemas of the kind agent frameworks send,
with unbounded strings, numbers and arrays, x 6 prompts x temperatures 0 and 0.8, seeded) and 12 forced
tool calls (a named function and ``required`` over two tools, 6 prompts x 2 temperatures). Each answer is
classed: ``valid`` (it ended by itself and parses and validates against its schema), ``cut``
(``finish_reason: "length"``: it ran to ``max_tokens`` without closing), ``invalid`` (it ended but does not
validate) or ``error`` (not a 200). A constrained decoder is valid by construction; what separates servers is
how many outputs run away (whitespace, digits, strings) until ``max_tokens``.

``mix`` is issue #21's throughput check: ``--concurrency`` streams where half the requests are JSON-schema
constrained, against the same number of unconstrained requests, alternating in ``--rounds`` so that both
see the same minutes of the machine. Every request generates exactly ``--output-len`` tokens: the
unconstrained ones with ``ignore_eos``, the constrained ones with a schema that cannot close sooner (an
array of at least ``--output-len`` strings), so the two runs do the same work but for the masks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema

REQUEST_TIMEOUT_S = 600.0

# NOTE: no maxLength / maximum / maxItems on purpose: these are the schemas pydantic models and agent
# frameworks produce, and the open-ended fields are where a small model runs away.
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "email": {"type": "string"},
            "hobbies": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "email", "hobbies"],
    },
    "product": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "price": {"type": "number"},
            "in_stock": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["title", "price", "in_stock", "tags"],
    },
    "event": {
        "type": "object",
        "properties": {
            "event": {"type": "string"},
            "year": {"type": "integer"},
            "attendees": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "role": {"enum": ["host", "guest", "speaker"]},
                    },
                    "required": ["name", "role"],
                },
            },
        },
        "required": ["event", "year", "attendees"],
    },
    "measurement": {
        "type": "object",
        "properties": {
            "sensor": {"type": "string"},
            "unit": {"enum": ["celsius", "kelvin", "pascal"]},
            "readings": {"type": "array", "items": {"type": "number"}, "minItems": 1},
        },
        "required": ["sensor", "unit", "readings"],
    },
}
PROMPTS = (
    "Answer in JSON.",
    "Make up an example and give it as JSON.",
    "Give a realistic example as a JSON object.",
    "Reply with JSON only: one example.",
    "Produce a JSON object describing something from a science museum.",
    "Return a short JSON record.",
)
TEMPERATURES = (0.0, 0.8)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "description": "Flights between two airports on a date, for a number of passengers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string"},
                    "destination": {"type": "string"},
                    "date": {"type": "string"},
                    "passengers": {"type": "integer", "minimum": 1},
                },
                "required": ["origin", "destination", "date", "passengers"],
            },
        },
    },
]
TOOL_PROMPTS = (
    "What is the weather in Paris?",
    "I need to fly from Boston to Denver next Friday with my two kids.",
    "Is it cold in Oslo right now, in fahrenheit?",
    "Find me a flight to Tokyo from London on 2026-03-01.",
    "Should I take an umbrella in Seattle today?",
    "Book-search flights SFO to JFK for 3 people tomorrow.",
)


@dataclass
class Outcome:
    """One request's class and what it generated."""

    kind: str  # "json_schema:<name>" or "tool:<named|required>"
    temperature: float
    status: str  # valid | cut | invalid | error
    finish_reason: str | None
    completion_tokens: int
    seconds: float
    detail: str = ""


def _validate_json(text: str, schema: dict[str, Any]) -> str:
    """'' when ``text`` is one JSON value valid against ``schema``, else why not."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    return ""


def _validate_tool_calls(message: dict[str, Any]) -> str:
    calls = message.get("tool_calls") or []
    if not calls:
        return "no tool_calls in the message"
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        name = call["function"]["name"]
        if name not in params:
            return f"unknown function {name!r}"
        why = _validate_json(call["function"]["arguments"], params[name])
        if why:
            return f"{name}: {why}"
    return ""


def _classify(kind: str, body: dict[str, Any], resp: httpx.Response, seconds: float) -> Outcome:
    temperature = float(body["temperature"])
    if resp.status_code != 200:
        return Outcome(kind, temperature, "error", None, 0, seconds, resp.text[:200])
    data = resp.json()
    choice = data["choices"][0]
    finish = choice.get("finish_reason")
    tokens = int(data.get("usage", {}).get("completion_tokens", 0))
    message = choice["message"]
    if finish == "length":
        text = message.get("content") or json.dumps(message.get("tool_calls"))
        return Outcome(kind, temperature, "cut", finish, tokens, seconds, f"...{text[-120:]!r}")
    if kind.startswith("tool:"):
        why = _validate_tool_calls(message)
    else:
        why = _validate_json(message.get("content") or "", body["response_format"]["json_schema"]["schema"])
    return Outcome(kind, temperature, "invalid" if why else "valid", finish, tokens, seconds, why)


def validity_requests(model: str, max_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    """The 48 schema requests and 12 tool calls, each ``(kind, body)``; seeded, so reruns match."""
    out: list[tuple[str, dict[str, Any]]] = []
    seed = 0
    for name, schema in SCHEMAS.items():
        for prompt in PROMPTS:
            for temperature in TEMPERATURES:
                seed += 1
                content = f"Describe a {name} as JSON. {prompt}"
                fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
                body = _chat(model, content, max_tokens, temperature, seed) | {"response_format": fmt}
                out.append((f"json_schema:{name}", body))
    for i, prompt in enumerate(TOOL_PROMPTS):
        for temperature in TEMPERATURES:
            seed += 1
            # NOTE: the weather prompts (even i) name get_weather; the others let the model pick one.
            named = {"type": "function", "function": {"name": "get_weather"}}
            forced: Any = "required" if i % 2 else named
            body = _chat(model, prompt, max_tokens, temperature, seed) | {
                "tools": TOOLS,
                "tool_choice": forced,
            }
            out.append(("tool:" + ("required" if i % 2 else "named"), body))
    return out


def _chat(model: str, content: str, max_tokens: int, temperature: float, seed: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
    }


async def _run_all(
    base_url: str, headers: dict[str, str], requests: list[tuple[str, dict[str, Any]]], concurrency: int
) -> list[Outcome]:
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, kind: str, body: dict[str, Any]) -> Outcome:
        async with limit:
            t0 = time.perf_counter()
            resp = await client.post(f"{base_url}/v1/chat/completions", json=body, headers=headers)
            return _classify(kind, body, resp, time.perf_counter() - t0)

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        return list(await asyncio.gather(*(one(client, k, b) for k, b in requests)))


def summarize_validity(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    """Counts per status for the schema requests and the tool calls, and the output tokens/s."""

    def counts(prefix: str) -> dict[str, int]:
        c = Counter(o.status for o in outcomes if o.kind.startswith(prefix))
        return {s: c.get(s, 0) for s in ("valid", "cut", "invalid", "error")}

    tokens = sum(o.completion_tokens for o in outcomes)
    return {
        "json_schema": counts("json_schema:"),
        "tool_calls": counts("tool:"),
        "cut_by_kind": dict(Counter(o.kind for o in outcomes if o.status == "cut")),
        "completion_tokens": tokens,
        "duration_s": round(seconds, 2),
        "output_tok_s": round(tokens / seconds, 2) if seconds > 0 else 0.0,
        "mean_tokens_valid": round(
            statistics.fmean([o.completion_tokens for o in outcomes if o.status == "valid"] or [0]), 1
        ),
    }


async def _model_id(base_url: str, headers: dict[str, str]) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.get(f"{base_url}/v1/models", headers=headers)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])


def run_validity(args: argparse.Namespace, headers: dict[str, str]) -> dict[str, Any]:
    model = args.model or asyncio.run(_model_id(args.base_url, headers))
    requests = validity_requests(model, args.max_tokens)
    t0 = time.perf_counter()
    outcomes = asyncio.run(_run_all(args.base_url, headers, requests, args.concurrency))
    summary = summarize_validity(outcomes, time.perf_counter() - t0)
    return {
        "label": args.label,
        "model": model,
        "summary": summary,
        "outcomes": [asdict(o) for o in outcomes],
    }


# ---------------------------------------------------------------- the constrained-half throughput mix
def mix_schema(output_len: int) -> dict[str, Any]:
    """A schema no output of ``output_len`` tokens can close: every constrained request runs to the end."""
    items = {"type": "array", "items": {"type": "string"}, "minItems": output_len}
    return {"type": "object", "properties": {"items": items}, "required": ["items"]}


def mix_requests(model: str, n: int, output_len: int, constrained: bool, seed: int) -> list[dict[str, Any]]:
    """``n`` completions of ``output_len`` tokens; with ``constrained``, every other one JSON-schema bound."""
    rng = random.Random(seed)
    words = "river stone apple cloud seven window garden copper violin north market silver lamp".split()
    out = []
    for i in range(n):
        prompt = "List things as JSON. " + " ".join(rng.choice(words) for _ in range(100))
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0}
        if constrained and i % 2 == 0:
            schema = mix_schema(output_len)
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "items", "schema": schema},
            }
        else:
            body["ignore_eos"] = True
        out.append(body)
    return out


async def _mix_once(
    base_url: str, headers: dict[str, str], bodies: list[dict[str, Any]], concurrency: int
) -> float:
    """Output tokens/s of one run (every request must generate its full ``max_tokens``)."""
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
        async with limit:
            resp = await client.post(f"{base_url}/v1/completions", json=body, headers=headers)
            resp.raise_for_status()
            tokens = int(resp.json()["usage"]["completion_tokens"])
            if tokens != body["max_tokens"]:
                raise RuntimeError(f"a request generated {tokens} tokens, not {body['max_tokens']}")
            return tokens

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(client, b) for b in bodies)))
        return tokens / (time.perf_counter() - t0)


def run_mix(args: argparse.Namespace, headers: dict[str, str]) -> dict[str, Any]:
    model = args.model or asyncio.run(_model_id(args.base_url, headers))
    n = args.num_prompts or 2 * args.concurrency
    warm = mix_requests(model, args.concurrency, 8, True, seed=99)
    asyncio.run(_mix_once(args.base_url, headers, [b | {"max_tokens": 8} for b in warm], args.concurrency))
    rounds = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        result = {}
        for constrained in order:
            # NOTE: each run its own prompts (same lengths), so that no run is served from the prefix cache.
            bodies = mix_requests(model, n, args.output_len, constrained, seed=2 * r + constrained)
            result["half_constrained" if constrained else "unconstrained"] = round(
                asyncio.run(_mix_once(args.base_url, headers, bodies, args.concurrency)), 2
            )
        result["ratio"] = round(result["half_constrained"] / result["unconstrained"], 4)
        print(json.dumps({"round": r + 1} | result), file=sys.stderr)
        rounds.append(result)
    ratios = [r["ratio"] for r in rounds]
    return {
        "label": args.label,
        "model": model,
        "concurrency": args.concurrency,
        "num_prompts": n,
        "output_len": args.output_len,
        "rounds": rounds,
        "ratio_geomean": round(statistics.geometric_mean(ratios), 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("validity", "mix"))
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model id to send (default: the first of GET /v1/models)")
    p.add_argument("--label", default=None)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256, help="validity: each request's max_tokens")
    p.add_argument(
        "--num-prompts", type=int, default=None, help="mix: requests per run (default 2 x concurrency)"
    )
    p.add_argument("--output-len", type=int, default=64, help="mix: tokens each request generates")
    p.add_argument("--rounds", type=int, default=3, help="mix: alternating pairs of runs")
    p.add_argument("--save-result", default=None, metavar="FILE.json")
    args = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    result = run_validity(args, headers) if args.mode == "validity" else run_mix(args, headers)
    text = json.dumps(result if args.mode == "mix" else result["summary"], indent=2)
    print(text)
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
