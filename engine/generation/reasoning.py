"""Reasoning output: a thinking model (Qwen3, DeepSeek-R1) writes ``<think> reasoning </think> answer``;
``ReasoningSplitter`` separates the reasoning from the answer, on the whole text or on streamed deltas.

    state = OPEN if the prompt already opened <think> else START
    START:      "<think>" first (after whitespace)  -> REASONING, the marker dropped
                anything else                        -> CONTENT
    REASONING:  text up to "</think>" is reasoning   -> CONTENT, the marker dropped
    CONTENT:    the rest is the answer

A delta that may be the beginning of a marker is held back until the next delta decides it, so the
streamed parts concatenate to exactly the parts of the whole text, however it was cut into deltas.
Text only: ``<think>`` is an ordinary (not special) token in these vocabularies, so it is in the text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


class _State(enum.Enum):
    START = "start"
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True)
class ReasoningDelta:
    """What one piece of output adds: to the reasoning, and to the answer."""

    reasoning: str = ""
    content: str = ""


def _held_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits one sample's output into reasoning and answer. ``opened``: the prompt ends with
    ``<think>`` (a template that starts the thinking itself), so the output begins inside it."""

    def __init__(self, opened: bool = False) -> None:
        self._state = _State.REASONING if opened else _State.START
        self._held = ""
        self.saw_reasoning = opened

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        """The parts ``text`` completes; ``final`` flushes what was held back (the output ended)."""
        buffer = self._held + text
        self._held = ""
        reasoning = ""
        if self._state is _State.START:
            stripped = buffer.lstrip()
            if stripped.startswith(THINK_START):
                self._state = _State.REASONING
                self.saw_reasoning = True
                buffer = stripped[len(THINK_START) :]
            elif THINK_START.startswith(stripped) and not final:
                self._held = buffer  # NOTE: whitespace or a part of "<think>": not decided yet
                return ReasoningDelta()
            else:
                self._state = _State.CONTENT
        if self._state is _State.REASONING:
            before, found, after = buffer.partition(THINK_END)
            if not found:
                keep = 0 if final else _held_suffix(buffer, THINK_END)
                self._held = buffer[len(buffer) - keep :]
                return ReasoningDelta(reasoning=buffer[: len(buffer) - keep])
            self._state = _State.CONTENT
            reasoning, buffer = before, after
        return ReasoningDelta(reasoning=reasoning, content=buffer)


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of a whole output, as vLLM's reasoning parsers return them: reasoning is
    None when the model did not think, content None when it wrote nothing after its thinking."""
    splitter = ReasoningSplitter(opened)
    delta = splitter.feed(text, final=True)
    if not splitter.saw_reasoning:
        return None, delta.content
    return delta.reasoning, delta.content or None


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when a rendered prompt ends inside ``<think>`` (the template opened the thinking)."""
    return prompt_text.rstrip().endswith(THINK_START)
