"""Chat outputs of a reasoning model: the ``<think>…</think>`` part goes to ``reasoning_content`` (vLLM's
field) and ``reasoning`` (its newer name), the rest to ``content``, in messages and in stream deltas.

On when ``--reasoning-parser`` says so: ``auto`` (the default) when the tokenizer has both ``<think>`` and
``</think>`` as tokens, ``none`` never, any other name always. The splitting itself is
``engine/generation/reasoning.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.generation.reasoning import (
    THINK_END,
    THINK_START,
    ReasoningDelta,
    ReasoningSplitter,
    prompt_opens_reasoning,
    split_reasoning,
)
from server.lifecycle import ServerState
from server.schemas import ChatResponseMessage

# NOTE: enough prompt tokens to hold "<think>" and the whitespace after it, however it is tokenized.
_PROMPT_TAIL_TOKENS = 8


def _tokenizer_knows_thinking(tokenizer: Any) -> bool:
    ids = tokenizer.convert_tokens_to_ids([THINK_START, THINK_END])
    return all(i is not None for i in ids)


class ChatReasoning:
    """How one chat request's outputs are split: ``enabled`` or not, and whether the prompt already
    opened the thinking. ``delta`` keeps one streaming splitter per choice."""

    def __init__(self, enabled: bool, opened: bool = False) -> None:
        self.enabled = enabled
        self.opened = opened
        self._splitters: dict[int, ReasoningSplitter] = {}

    @classmethod
    def for_request(cls, state: ServerState, prompt_ids: Sequence[int]) -> ChatReasoning:
        parser = state.config.reasoning_parser
        tokenizer = state.engine.tokenizer
        if parser == "none" or tokenizer is None:
            return cls(False)
        if parser == "auto" and not _tokenizer_knows_thinking(tokenizer):
            return cls(False)
        tail = tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        return cls(True, prompt_opens_reasoning(tail))

    def message(self, message: ChatResponseMessage) -> ChatResponseMessage:
        """``message`` with its thinking moved out of ``content`` (unchanged when off or not text)."""
        if not self.enabled or message.content is None:
            return message
        reasoning, content = split_reasoning(message.content, self.opened)
        return message.model_copy(
            update={"content": content, "reasoning_content": reasoning, "reasoning": reasoning}
        )

    def delta(self, index: int, text: str, final: bool) -> dict[str, Any]:
        """The delta fields of choice ``index``'s next piece of text (empty when there is nothing to send
        yet); ``final``: the choice's last piece."""
        if not self.enabled:
            return {"content": text} if text else {}
        splitter = self._splitters.setdefault(index, ReasoningSplitter(self.opened))
        return _delta_fields(splitter.feed(text, final))


def _delta_fields(delta: ReasoningDelta) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if delta.reasoning:
        fields["reasoning_content"] = delta.reasoning
        fields["reasoning"] = delta.reasoning
    if delta.content:
        fields["content"] = delta.content
    return fields
