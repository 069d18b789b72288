"""The reasoning parser on scripted outputs: whole and streamed in every cut, the parts are the same."""

from __future__ import annotations

import random

import pytest

from engine.generation.reasoning import ReasoningSplitter, prompt_opens_reasoning, split_reasoning

# (output, prompt opened <think>, expected reasoning, expected content)
CASES: list[tuple[str, bool, str | None, str | None]] = [
    ("<think>\nLet me add.\n</think>\n\n4", False, "\nLet me add.\n", "\n\n4"),
    ("  <think>a</think>b", False, "a", "b"),
    ("The answer is 4.", False, None, "The answer is 4."),
    ("", False, None, ""),
    ("<think>still thinking when max_tokens ran out", False, "still thinking when max_tokens ran out", None),
    ("<think>done</think>", False, "done", None),
    ("<thinking>not a marker", False, None, "<thinking>not a marker"),
    ("<thi", False, None, "<thi"),
    ("Hi <think>x</think>", False, None, "Hi <think>x</think>"),
    ("a < b </think> so 4", True, "a < b ", " so 4"),
    ("thought </thi", True, "thought </thi", None),
    ("no end marker", True, "no end marker", None),
    ("<think>one</think>two</think>", False, "one", "two</think>"),
]


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_whole_output(text: str, opened: bool, reasoning: str | None, content: str | None) -> None:
    assert split_reasoning(text, opened) == (reasoning, content)


def _streamed(text: str, opened: bool, cuts: list[int]) -> tuple[str, str]:
    splitter = ReasoningSplitter(opened)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        delta = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning += delta.reasoning
        content += delta.content
    return reasoning, content


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_streamed_in_every_cut_equals_whole(
    text: str, opened: bool, reasoning: str | None, content: str | None
) -> None:
    rng = random.Random(len(text))
    cut_sets = [[i] for i in range(1, len(text))]  # every single cut, markers split anywhere
    cut_sets += [list(range(1, len(text))), []]  # one character per delta; one delta
    cut_sets += [sorted(rng.sample(range(1, len(text)), min(3, max(len(text) - 1, 0)))) for _ in range(20)]
    for cuts in cut_sets:
        assert _streamed(text, opened, cuts) == (reasoning or "", content or ""), cuts


def test_a_held_marker_prefix_is_released_when_it_is_not_one() -> None:
    splitter = ReasoningSplitter()
    assert splitter.feed("<thi").content == ""  # may become <think>: held
    assert splitter.feed("s is html").content == "<this is html"
    opened = ReasoningSplitter(opened=True)
    assert opened.feed("x </th").reasoning == "x "
    assert opened.feed("ere>").reasoning == "</there>"


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
