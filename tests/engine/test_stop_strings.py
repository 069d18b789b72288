"""Stop strings with StopStringCriteria's semantics (transformers seed 000), matched on text."""

from __future__ import annotations

import pytest

from engine.generation.stop_strings import StopStringMatcher

# The StopStringCriteria docstring's cases for the stop string "stop".
MATCH = [["st", "op"], ["stop"], ["st", "opera"], ["sto", "pper"], ["las", "topper"], ["s", "to", "pped"]]
NO_MATCH = [["stop", "at"], ["st", "op", "at"], ["st", "opera", "tion"]]


@pytest.mark.parametrize("tokens", MATCH, ids=["+".join(t) for t in MATCH])
def test_seed_cases_match(tokens: list[str]) -> None:
    assert StopStringMatcher(["stop"]).matches_tokens(tokens)


@pytest.mark.parametrize("tokens", NO_MATCH, ids=["+".join(t) for t in NO_MATCH])
def test_seed_cases_do_not_match(tokens: list[str]) -> None:
    matcher = StopStringMatcher(["stop"])
    assert not matcher.matches_tokens(tokens)
    # ...because the stop string completed at an earlier token, where a step-by-step check catches it
    assert any(matcher.matches_tokens(tokens[:k]) for k in range(1, len(tokens)))


def _first_stop_step(matcher: StopStringMatcher, tokens: list[str]) -> tuple[int, int] | None:
    """Feed tokens one by one as the engine does; (step, cut position) of the first match."""
    text = ""
    for step, tok in enumerate(tokens):
        checked = len(text)
        text += tok
        pos = matcher.find(text, checked)
        if pos is not None:
            return step, pos
    return None


def test_caught_at_the_completing_step_and_cut_before_it() -> None:
    matcher = StopStringMatcher(["stop"])
    assert _first_stop_step(matcher, ["Please ", "s", "to", "pped", " there"]) == (3, 7)
    assert _first_stop_step(matcher, ["las", "topper"]) == (1, 2)
    assert _first_stop_step(matcher, ["no", " st", "ops", "?"]) == (2, 3)
    assert _first_stop_step(matcher, ["s", "t", "o", "o", "p"]) is None


def test_earliest_of_several_stop_strings_wins() -> None:
    matcher = StopStringMatcher(["world", "lo w", "\n\n"])
    text = "hello world"
    assert matcher.find(text, 0) == 3  # "lo w" starts before "world"
    assert matcher.find("a\n\nb world", 0) == 1


def test_only_text_overlapping_new_text_is_searched() -> None:
    matcher = StopStringMatcher(["stop"])
    assert matcher.find("stop and more", 5) is None  # wholly in the already-checked text
    assert matcher.find("xxstop", 3) == 2  # overlaps the new text "op"
    assert matcher.find("xxstop", 6) is None  # no new text


def test_partial_suffix_is_held_back() -> None:
    matcher = StopStringMatcher(["stop", "END"])
    assert matcher.partial_suffix_len("we st") == 2
    assert matcher.partial_suffix_len("we sto") == 3
    assert matcher.partial_suffix_len("we s") == 1
    assert matcher.partial_suffix_len("we E") == 1
    assert matcher.partial_suffix_len("we EN") == 2
    assert matcher.partial_suffix_len("we x") == 0
    assert matcher.partial_suffix_len("stop") == 0  # a full match is not a partial one
    assert matcher.partial_suffix_len("") == 0


def test_unicode_and_empty() -> None:
    matcher = StopStringMatcher(["。", "😀!"])
    assert _first_stop_step(matcher, ["你好", "。", "再见"]) == (1, 2)
    assert _first_stop_step(matcher, ["a😀", "!"]) == (1, 1)
    assert matcher.partial_suffix_len("a😀") == 1
    assert not StopStringMatcher([])
    assert StopStringMatcher([]).find("anything", 0) is None
    with pytest.raises(ValueError):
        StopStringMatcher([""])
