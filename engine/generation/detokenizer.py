"""Incremental detokenization (the vLLM/TGI prefix-offset / read-offset scheme), built only on
``tokenizer.decode(ids, skip_special_tokens=...)``.

Each step decodes a short window: the tokens from ``prefix_offset`` (a little context already emitted)
to the end, and emits what it adds over the decode of ``prefix_offset:read_offset``. A window whose text
ends in U+FFFD is an unfinished UTF-8 character (or a token a later one rewrites): nothing is emitted
until a later token completes it. So a stream never shows a broken character, the deltas concatenate to
``decode(all ids)``, and each step costs O(window), not O(output length).
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """What detokenization needs from a tokenizer (``engine/loader/tokenizer.py`` and HF tokenizers have it)."""

    def decode(self, ids: list[int], /, skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TokenDecoder, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.prefix_offset = 0  # window start: context tokens, already emitted
        self.read_offset = 0  # tokens before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it makes final (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        if not new_text.startswith(prefix_text):
            # NOTE: the new token rewrote the context (a tokenizer whose decode is not prefix-stable):
            # wait, and let a later step or finish() emit the settled text.
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Emit everything not yet emitted (a trailing U+FFFD included): afterwards ``text`` equals
        ``decode(all ids)``. Decodes the whole output once."""
        final = self._decode(self.ids)
        if final.startswith(self.text):
            delta = final[len(self.text) :]
        else:  # cannot happen with a prefix-stable decode; emit the window's remainder instead
            prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
            delta = self._decode(self.ids[self.prefix_offset :])[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
