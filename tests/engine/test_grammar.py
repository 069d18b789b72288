"""The grammar interface (engine/generation/grammar.py) on the default model's tokenizer, with scripted
logits: masks, EOS once complete, forks, rollback, the cache, and errors naming the field."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from grammar_bombs import all_of_choices, nested_schema

from engine.generation.config import GenerationConfig, GenerationConfigError
from engine.generation.errors import GrammarTooComplexError
from engine.generation.grammar import GrammarCompiler, GrammarMatcher, GrammarMatcherError, bitmask_words
from engine.generation.grammar_mask import apply_token_bitmask
from engine.generation.grammar_spec import MAX_SPEC_CHARS, GrammarSpec
from engine.generation.rows import SamplingRow
from engine.generation.sampler import Sampler
from engine.loader.tokenizer import Tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(smollm2_reader: Any) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_reader)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, (EOS,), max_cached=2)


def allowed(matcher: GrammarMatcher, vocab: int, eos: tuple[int, ...] = (EOS,)) -> set[int]:
    bitmask = torch.zeros((1, bitmask_words(vocab)), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0, eos)
    logits = torch.zeros((1, vocab))
    apply_token_bitmask(logits, bitmask, [0])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def greedy_text(tokenizer: Tokenizer, matcher: GrammarMatcher, prefer: str, steps: int = 20) -> str:
    """Drive ``matcher`` with scripted logits that prefer the tokens of ``prefer``: the sampler must
    still pick only allowed tokens, and stop at EOS."""
    sampler = Sampler(tokenizer.vocab_size, eos_token_ids=(EOS,))
    config = GenerationConfig()
    wanted = tokenizer.encode(prefer, add_special_tokens=False)
    out: list[int] = []
    for step in range(steps):
        logits = torch.zeros((1, tokenizer.vocab_size))
        if step < len(wanted):
            logits[0, wanted[step]] = 10.0
        row = SamplingRow(config, [1], out, eos_token_ids=(EOS,), grammar=matcher)
        token = sampler.sample(logits, [row])[0]
        assert token.error is None
        if token.token_id == EOS:
            break
        matcher.accept_token(token.token_id)
        out.append(token.token_id)
    return tokenizer.decode(out)


def test_choice_masks_and_then_allows_only_eos(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(GrammarSpec.choice(["yes", "no"])).matcher()
    first = allowed(matcher, tokenizer.vocab_size)
    assert EOS not in first
    assert set(tokenizer.encode("yes", add_special_tokens=False)) <= first
    assert tokenizer.encode("maybe", add_special_tokens=False)[0] not in first
    for t in tokenizer.encode("no", add_special_tokens=False):
        matcher.accept_token(t)
    assert matcher.is_accepting() and matcher.is_terminated()
    assert allowed(matcher, tokenizer.vocab_size) == {EOS}


def test_scripted_logits_cannot_break_the_grammar(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(GrammarSpec.regex(r"[0-9]{3}")).matcher()
    # the logits prefer words; the mask leaves only digits, then EOS
    text = greedy_text(tokenizer, matcher, "hello world")
    assert len(text) == 3 and text.isdigit()


def test_a_rejected_token_raises(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(GrammarSpec.regex(r"[0-9]+")).matcher()
    with pytest.raises(GrammarMatcherError):
        matcher.accept_token(tokenizer.encode("abc", add_special_tokens=False)[0])


def test_copy_is_independent_and_rollback_restores(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(GrammarSpec.choice(["ab", "cd"])).matcher()
    start = allowed(matcher, tokenizer.vocab_size)
    fork = matcher.copy()
    for t in tokenizer.encode("ab", add_special_tokens=False):
        matcher.accept_token(t)
    assert allowed(fork, tokenizer.vocab_size) == start  # the fork did not move
    matcher.rollback(len(tokenizer.encode("ab", add_special_tokens=False)))
    assert allowed(matcher, tokenizer.vocab_size) == start


def test_valid_prefix_cuts_drafts_where_the_grammar_stops_allowing_them(
    tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    matcher = compiler.compile(GrammarSpec.regex(r"The quick brown fox [a-z ]{1,40}\.")).matcher()
    good = tokenizer.encode("The quick brown", add_special_tokens=False)
    bad = tokenizer.encode(" slow", add_special_tokens=False)
    start = allowed(matcher, tokenizer.vocab_size)
    assert matcher.valid_prefix(good) == len(good)
    assert matcher.valid_prefix(good + bad) == len(good)
    assert matcher.valid_prefix(bad) == 0
    assert allowed(matcher, tokenizer.vocab_size) == start  # looking does not move the matcher


def test_compiled_grammars_are_cached_with_a_bound(compiler: GrammarCompiler) -> None:
    a = compiler.compile(GrammarSpec.regex("a+"))
    assert compiler.compile(GrammarSpec.regex("a+", "guided_regex")) is a  # the field is not in the key
    compiler.compile(GrammarSpec.regex("b+"))
    compiler.compile(GrammarSpec.regex("c+"))
    assert compiler.num_cached == 2
    assert compiler.compile(GrammarSpec.regex("a+")) is not a  # evicted, compiled again


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (lambda: GrammarSpec.json_schema({"type": "frobnicate"}, "response_format"), "response_format"),
        (lambda: GrammarSpec.regex("a(b", "guided_regex"), "guided_regex"),
        (lambda: GrammarSpec.grammar("start: nowhere", "guided_grammar"), "guided_grammar"),
    ],
)
def test_a_rejected_spec_names_its_field(compiler: GrammarCompiler, spec: Any, field: str) -> None:
    with pytest.raises(GenerationConfigError) as info:
        compiler.compile(spec())
    assert info.value.field == field


def test_spec_and_config_validation() -> None:
    with pytest.raises(GenerationConfigError, match="choice"):
        GrammarSpec.choice([])
    with pytest.raises(GenerationConfigError, match="not valid JSON"):
        GrammarSpec.json_schema("{nope")
    with pytest.raises(GenerationConfigError) as info:
        GenerationConfig(structured_output=GrammarSpec.json_object(), ignore_eos=True)
    assert info.value.field == "ignore_eos"
    assert GrammarSpec.json_schema({"b": 1, "a": 2}) == GrammarSpec.json_schema('{"b": 1, "a": 2}')
    GrammarSpec.regex("a" * MAX_SPEC_CHARS)  # at the limit: kept
    with pytest.raises(GenerationConfigError, match="too large") as info:
        GrammarSpec.regex("a" * (MAX_SPEC_CHARS + 1), "guided_regex")
    assert info.value.field == "guided_regex"
    with pytest.raises(GenerationConfigError, match="too large"):  # a huge enum: refused before compiling
        GrammarSpec.json_schema({"enum": [f"value-{i}" for i in range(100_000)]})


UNWRITABLE = "\U000bf838"  # SmolLM2's vocabulary has no token for its UTF-8 lead byte 0xF2


@pytest.mark.parametrize(
    "spec",
    [
        lambda: GrammarSpec.choice(["yes", f"no{UNWRITABLE}"], "guided_choice"),
        lambda: GrammarSpec.regex(f"a{UNWRITABLE}+", "guided_choice"),
        lambda: GrammarSpec.json_schema({"enum": [f"x{UNWRITABLE}"]}, "guided_choice"),
        lambda: GrammarSpec.json_schema({"properties": {UNWRITABLE: {"type": "integer"}}}, "guided_choice"),
    ],
    ids=["choice", "regex", "enum", "property-name"],
)
def test_a_literal_the_vocabulary_cannot_write_is_refused(compiler: GrammarCompiler, spec: Any) -> None:
    with pytest.raises(GenerationConfigError, match="U\\+BF838 cannot be written") as info:
        compiler.compile(spec())
    assert info.value.field == "guided_choice"


def test_writable_non_ascii_literals_compile(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    compiled = compiler.compile(GrammarSpec.choice(["中文", "😀", "é"]))
    assert greedy_text(tokenizer, compiled.matcher(), "😀") == "😀"


@pytest.mark.parametrize(
    "spec",
    [
        lambda: GrammarSpec.json_schema(nested_schema(300), "response_format"),  # past the nesting limit
        lambda: GrammarSpec.json_schema(all_of_choices(20), "response_format"),  # 2^20 alternatives
        lambda: GrammarSpec.regex("(.{0,100}){0,100}x", "response_format"),  # too many lexer states
    ],
    ids=["deep-nesting", "all-of-choices", "regex-blowup"],
)
def test_a_spec_past_the_library_limits_is_too_complex(compiler: GrammarCompiler, spec: Any) -> None:
    with pytest.raises(GrammarTooComplexError, match="too complex") as info:
        compiler.compile(spec())
    assert info.value.field == "response_format"
    # Remembered: asked again (from another field) it fails at once with that field, nothing recompiled.
    again = spec()
    again = type(again)(again.kind, again.text, "guided_json")
    with pytest.raises(GrammarTooComplexError) as info:
        compiler.cached(again)
    assert info.value.field == "guided_json"


def test_a_failing_matcher_fails_only_its_row(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    class Broken(GrammarMatcher):
        def fill_bitmask(self, bitmask: torch.Tensor, row: int, eos_token_ids: Any = ()) -> None:
            raise RuntimeError("boom")

    good = compiler.compile(GrammarSpec.choice(["yes"])).matcher()
    broken = Broken(compiler.compile(GrammarSpec.choice(["no"])).matcher()._matcher)
    sampler = Sampler(tokenizer.vocab_size, eos_token_ids=(EOS,))
    config = GenerationConfig()
    rows = [
        SamplingRow(config, [1], [], grammar=broken),
        SamplingRow(config, [1], [], grammar=good),
        SamplingRow(config, [1], []),
    ]
    logits = torch.zeros((3, tokenizer.vocab_size))
    logits[:, 5] = 1.0
    for ahead in (False, True):  # masks computed by the sampler, or ahead on the worker thread
        if ahead:
            with sampler.masks_ahead(rows) as masks:
                tokens = sampler.sample(logits.clone(), rows, masks)
        else:
            tokens = sampler.sample(logits.clone(), rows)
        assert tokens[0].error is not None and "boom" in tokens[0].error
        assert tokens[1].token_id in tokenizer.encode("yes", add_special_tokens=False)
        assert tokens[2].token_id == 5  # the unconstrained row is untouched
