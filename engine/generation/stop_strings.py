"""Stop strings, matched on the detokenized text with ``StopStringCriteria``'s semantics.

A stop string fires at the step whose new text completes it: it may be spread over several tokens, end
inside a token (``["st", "opera"]``) or start inside one (``["las", "topper"]``), but it must overlap the
newest text: an occurrence wholly inside earlier text never fires later (``["stop", "at"]`` at the
``"at"`` step). Each check reads only the new text plus ``max_len - 1`` characters before it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        # NOTE: dict.fromkeys keeps the first-given order and drops duplicates.
        self.stop_strings = list(dict.fromkeys(stop_strings))
        self.max_len = max((len(s) for s in self.stop_strings), default=0)

    def __bool__(self) -> bool:
        return bool(self.stop_strings)

    def find(self, text: str, new_from: int) -> int | None:
        """Start of the earliest stop string in ``text`` that ends after ``new_from`` (the length of the
        text already checked), or None. The returned text is cut there (OpenAI: it excludes the stop)."""
        best: int | None = None
        for s in self.stop_strings:
            # an occurrence starting here or later ends at or after new_from + 1: it overlaps the new text
            pos = text.find(s, max(0, new_from - len(s) + 1))
            if pos != -1 and (best is None or pos < best):
                best = pos
        return best

    def partial_suffix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string: text a
        later token may turn into a stop string, so a stream must hold it back."""
        for k in range(min(len(text), self.max_len - 1), 0, -1):
            tail = text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stop_strings):
                return k
        return 0

    def matches_tokens(self, token_texts: Sequence[str]) -> bool:
        """``StopStringCriteria`` on a whole sequence: does its LAST token complete a stop string?"""
        if not token_texts:
            return False
        text = "".join(token_texts)
        return self.find(text, len(text) - len(token_texts[-1])) is not None
