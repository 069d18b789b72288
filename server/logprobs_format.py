"""The engine's per-token log-probabilities in OpenAI's two shapes.

- completions: ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``;
- chat: ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.

A token's string is its own decoded text (special tokens included), as OpenAI and vLLM report it;
``text_offset`` is where that string starts in the choice's text, counted across stream chunks.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from engine.outputs import TokenLogprob
from server.schemas import (
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprobs,
    PromptTokenLogprob,
)


class TokenStrings:
    """Decodes single token ids, cached (the same ids recur in every top-N list)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.of = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return str(self._tokenizer.decode([token_id], skip_special_tokens=False))


def completion_logprobs(
    entries: list[TokenLogprob], strings: TokenStrings, num_top: int, offset: int
) -> tuple[CompletionLogprobs, int]:
    """Logprobs of generated tokens, text offsets starting at ``offset``; returns them and the offset
    after the last token. The top dict holds ``num_top`` alternatives plus the chosen token (vLLM's
    convention, so that ``logprobs=0`` still shows the chosen one)."""
    out = CompletionLogprobs()
    for entry in entries:
        token = strings.of(entry.token_id)
        top: dict[str, float] = {strings.of(t): lp for t, lp in entry.top[:num_top]}
        top.setdefault(token, entry.logprob)
        out.tokens.append(token)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out, offset


def prompt_logprobs(
    prompt_ids: list[int], entries: list[TokenLogprob | None] | None, strings: TokenStrings, num_top: int
) -> tuple[CompletionLogprobs, int]:
    """The echoed prompt's tokens for ``echo`` with ``logprobs``: each token's log-probability given the
    ones before (null for the first, as OpenAI returns it), with ``num_top`` alternatives plus the token."""
    out = CompletionLogprobs()
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        token = strings.of(token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry.logprob if entry is not None else None)
        top: dict[str, float] | None = None
        if entry is not None:
            top = {strings.of(t): lp for t, lp in entry.top[:num_top]}
            top.setdefault(token, entry.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out, offset


def vllm_prompt_logprobs(
    entries: list[TokenLogprob | None] | None, strings: TokenStrings, num_top: int
) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) the token and its ``num_top``
    alternatives,
    keyed by token id, each with its log-probability, rank and text."""
    if entries is None:
        return None
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        top = entry.top[:num_top]  # NOTE: the engine may have scored more (echo with a larger logprobs)
        ranked: dict[int, tuple[float, int | None]] = {t: (lp, k + 1) for k, (t, lp) in enumerate(top)}
        ranked[entry.token_id] = (entry.logprob, entry.rank)
        out.append(
            {
                str(t): PromptTokenLogprob(logprob=lp, rank=rank, decoded_token=strings.of(t))
                for t, (lp, rank) in ranked.items()
            }
        )
    return out


def concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def chat_logprobs(entries: list[TokenLogprob], strings: TokenStrings, num_top: int) -> list[ChatTokenLogprob]:
    out: list[ChatTokenLogprob] = []
    for entry in entries:
        token = strings.of(entry.token_id)
        top = [
            ChatTopLogprob(token=strings.of(t), logprob=lp, bytes=list(strings.of(t).encode()))
            for t, lp in entry.top[:num_top]
        ]
        out.append(
            ChatTokenLogprob(token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=top)
        )
    return out
