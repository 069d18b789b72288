"""Whether a structured output's literal characters can be written with the model's vocabulary.

A byte-level vocabulary may lack tokens for some bytes (SmolLM2's has no token for the UTF-8 lead byte
0xF2, so no character from U+80000 to U+BFFFF can be written). A spec that spells such a character as a
literal (a choice option, an enum or const value, a property name, a regex or grammar literal) could
never be followed: llguidance's mask still offers the character's later bytes and the matcher then
refuses them, mid-generation. Found at admission instead, as a 400 naming the field.

Only the characters spelt out are checked (a regex class such as ``[^a]`` leaves the library free to
pick writable ones); every non-ASCII character of the spec is tried once, all together, and one by one
only when the whole does not survive the round trip.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import llguidance

from engine.generation.grammar_spec import GrammarSpec

_JSON_KINDS = frozenset({"json_schema", "json_object", "choice"})


def unwritable_character(tokenizer: llguidance.LLTokenizer, spec: GrammarSpec) -> str | None:
    """The first literal character of ``spec`` the vocabulary cannot write, or None."""
    characters = sorted({c for text in _literal_texts(spec) for c in text if ord(c) > 0x7F})
    if not characters or _writable(tokenizer, "".join(characters)):
        return None
    return next((c for c in characters if not _writable(tokenizer, c)), None)


def _writable(tokenizer: llguidance.LLTokenizer, text: str) -> bool:
    data = text.encode("utf-8", "surrogatepass")
    return bytes(tokenizer.decode_bytes(tokenizer.tokenize_bytes(data))) == data


def _literal_texts(spec: GrammarSpec) -> Iterator[str]:
    if spec.kind not in _JSON_KINDS:
        yield spec.text
        return
    yield from _strings(json.loads(spec.text))


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included (no recursion: a schema may nest deeper than Python)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            yield from item.keys()
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
