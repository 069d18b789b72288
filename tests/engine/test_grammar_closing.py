"""Closing a JSON output before ``max_new_tokens`` cuts it (engine/generation/grammar_closing.py), on the
default model's tokenizer with scripted logits: the plan from any prefix completes a valid document, a model
that loops is closed within its budget, and only JSON grammars are closed."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from engine.generation.config import GenerationConfig
from engine.generation.grammar import GrammarCompiler, GrammarMatcher
from engine.generation.grammar_spec import GrammarSpec
from engine.generation.rows import SamplingRow
from engine.generation.sampler import Sampler
from engine.loader.tokenizer import Tokenizer

EOS = 2

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 1},
            "hobbies": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        },
        "required": ["name", "age", "hobbies"],
    },
    "event": {
        "type": "object",
        "properties": {
            "year": {"type": "integer"},
            "attendees": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "role": {"enum": ["host", "guest"]}},
                    "required": ["name", "role"],
                },
            },
            "ok": {"type": "boolean"},
        },
        "required": ["year", "attendees", "ok"],
    },
    "readings": {
        "type": "object",
        "properties": {
            "unit": {"enum": ["celsius", "kelvin"]},
            "values": {"type": "array", "items": {"type": "number"}},
        },
        "required": ["unit", "values"],
    },
}
DOCUMENTS = {
    "person": '{"name": "Ada \\"A\\" L", "age": 36, "hobbies": ["maths", "poetry"]}',
    "event": '{"year": 1815, "attendees": [{"name": "Ada", "role": "host"}, {"name": "Bob", "role": "guest"}], "ok": true}',
    "readings": '{"unit": "kelvin", "values": [1.5, -2, 3e2, 40]}',
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_reader: Any) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_reader)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, (EOS,))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_the_plan_from_every_prefix_completes_a_valid_document(
    name: str, tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    compiled = compiler.compile(GrammarSpec.json_schema(SCHEMAS[name]))
    planner = compiler._planner
    assert planner is not None
    ids = tokenizer.encode(DOCUMENTS[name], add_special_tokens=False)
    for cut in range(len(ids) + 1):
        matcher = compiled.matcher()
        for t in ids[:cut]:
            matcher.accept_token(t)
        plan = planner.plan(matcher._matcher, 1024)
        assert plan is not None, f"no plan after {tokenizer.decode(ids[:cut])!r}"
        text = tokenizer.decode(ids[:cut]) + plan.decode()
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def run_scripted(
    tokenizer: Tokenizer, matcher: GrammarMatcher, loop_text: str, opening: str, budget: int
) -> tuple[list[int], bool]:
    """A model that writes ``opening`` then repeats ``loop_text`` forever, greedy, through the sampler's
    masks, for at most ``budget`` tokens; returns its tokens and whether it ended with EOS."""
    sampler = Sampler(tokenizer.vocab_size, eos_token_ids=(EOS,))
    config = GenerationConfig()
    script = tokenizer.encode(opening, add_special_tokens=False)
    loop = tokenizer.encode(loop_text, add_special_tokens=False)
    rank = torch.randperm(tokenizer.vocab_size, generator=torch.Generator().manual_seed(0)).float() / 1e6
    out: list[int] = []
    for step in range(budget):
        wanted = script[step] if step < len(script) else loop[(step - len(script)) % len(loop)]
        logits = rank.clone().unsqueeze(0)
        logits[0, EOS] = -5.0  # NOTE: the model never wants to stop
        logits[0, wanted] = 10.0
        row = SamplingRow(config, [1], out, eos_token_ids=(EOS,), grammar=matcher)
        token = sampler.sample(logits, [row])[0]
        assert token.error is None, token.error
        if token.token_id == EOS:
            return out, True
        matcher.accept_token(token.token_id)
        out.append(token.token_id)
    return out, False


@pytest.mark.parametrize(
    ("name", "opening", "loop_text"),
    [
        ("person", '{"name": "', "john_"),  # a string that never ends
        ("person", '{"name": "J", "age": ', "1"),  # digits forever
        ("readings", '{"unit": "kelvin", "values": [', "1.5, "),  # an array that never ends
        ("event", '{"year": 2000, "attendees": [', '{"name": "Liam", "role": "guest"}, '),
        ("event", "{", "\n"),  # whitespace forever
    ],
)
@pytest.mark.parametrize("budget", [40, 64, 130])
def test_a_looping_model_is_closed_within_its_budget(
    name: str, opening: str, loop_text: str, budget: int, tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    matcher = compiler.compile(GrammarSpec.json_schema(SCHEMAS[name])).matcher(budget)
    out, ended = run_scripted(tokenizer, matcher, loop_text, opening, budget)
    assert ended, f"cut at {budget} tokens: {tokenizer.decode(out)[-80:]!r}"
    assert len(out) < budget  # the EOS itself fits in the budget
    jsonschema.validate(json.loads(tokenizer.decode(out)), SCHEMAS[name])
    if budget >= 64:  # NOTE: with less, the shortest document plus the margin fills the budget from the start
        assert tokenizer.decode(out).startswith(opening.rstrip())


def test_without_a_budget_or_for_a_regex_the_loop_runs_to_the_end(
    tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    unbounded = compiler.compile(GrammarSpec.json_schema(SCHEMAS["person"])).matcher()
    _, ended = run_scripted(tokenizer, unbounded, "john_", '{"name": "', 64)
    assert not ended
    regex = compiler.compile(GrammarSpec.regex("[a-z_]+(@x)?")).matcher(64)
    _, ended = run_scripted(tokenizer, regex, "john_", "", 64)
    assert not ended  # NOTE: a free-text match cut short is not a complete answer; it is never closed


def test_a_budget_too_small_for_any_document_ends_by_length(
    tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    matcher = compiler.compile(GrammarSpec.json_schema(SCHEMAS["event"])).matcher(8)
    out, ended = run_scripted(tokenizer, matcher, "\n", "{", 8)
    assert not ended and len(out) == 8


def test_a_forked_matcher_keeps_the_tokens_its_parent_spent(
    tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    parent = compiler.compile(GrammarSpec.json_schema(SCHEMAS["person"])).matcher(40)
    for t in tokenizer.encode('{"name": "', add_special_tokens=False):
        parent.accept_token(t)
    child = parent.copy()
    spent = len(tokenizer.encode('{"name": "', add_special_tokens=False))
    out, ended = run_scripted(tokenizer, child, "john_", "", 40 - spent)
    assert ended and len(out) < 40 - spent
    parent.rollback(1)  # rolling back gives the token back to the budget
    assert parent._closing is not None and parent._closing.num_accepted == spent - 1
