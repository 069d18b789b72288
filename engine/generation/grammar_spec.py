"""What a request's output must match (structured outputs): a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a grammar (Lark, or llama.cpp's GBNF).

A ``GrammarSpec`` is the key of the compiled-grammar cache (engine/generation/grammar.py): its text is
canonical (a schema is dumped as JSON once), so equal requests share one compilation. ``field`` names
the request field the spec came from, so that an error about it names that field (HTTP 400); it is not
part of the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.generation.errors import GenerationConfigError

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
DEFAULT_FIELD = "structured_output"
# NOTE: compiling costs time and memory that grow with the text; the largest real schemas (128 tools
# with their parameters) are a few hundred kB, so a longer one is refused before anything is compiled.
MAX_SPEC_CHARS = 1 << 20


@dataclass(frozen=True)
class GrammarSpec:
    """``kind`` and its ``text``: the schema as JSON (json_schema; ``{"type": "object"}`` for
    json_object), the pattern (regex), the options as a JSON list of strings (choice), the grammar's
    source (grammar). Use the constructors below, which canonicalize and validate."""

    kind: GrammarKind
    text: str
    field: str = field(default=DEFAULT_FIELD, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GenerationConfigError(
                self.field,
                f"unknown structured output kind {self.kind!r} (known: {', '.join(GRAMMAR_KINDS)})",
            )
        if not isinstance(self.text, str) or not self.text.strip():
            raise GenerationConfigError(self.field, f"the {self.kind} must be a non-empty string")
        if len(self.text) > MAX_SPEC_CHARS:
            raise GenerationConfigError(
                self.field,
                f"the {self.kind} is too large: {len(self.text)} characters, at most {MAX_SPEC_CHARS}",
            )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def json_schema(cls, schema: Any, field_name: str = DEFAULT_FIELD) -> GrammarSpec:
        """A JSON schema: an object (or ``true``), or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GenerationConfigError(field_name, f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (Mapping, bool)):
            raise GenerationConfigError(
                field_name, f"a JSON schema must be an object or a boolean, got {type(schema).__name__}"
            )
        # NOTE: keys keep their order: the output lists the properties in the schema's order.
        return cls("json_schema", json.dumps(schema), field_name)

    @classmethod
    def json_object(cls, field_name: str = DEFAULT_FIELD) -> GrammarSpec:
        """Any JSON object (OpenAI's ``json_object`` response format)."""
        return cls("json_object", '{"type": "object"}', field_name)

    @classmethod
    def regex(cls, pattern: str, field_name: str = DEFAULT_FIELD) -> GrammarSpec:
        if not isinstance(pattern, str):
            raise GenerationConfigError(field_name, f"a regex must be a string, got {type(pattern).__name__}")
        return cls("regex", pattern, field_name)

    @classmethod
    def choice(cls, options: Sequence[str], field_name: str = DEFAULT_FIELD) -> GrammarSpec:
        """Exactly one of ``options`` (non-empty strings)."""
        if isinstance(options, str) or not isinstance(options, Sequence) or not options:
            raise GenerationConfigError(field_name, "choice must be a non-empty list of strings")
        for option in options:
            if not isinstance(option, str) or not option:
                raise GenerationConfigError(
                    field_name, f"every choice must be a non-empty string, got {option!r}"
                )
        return cls("choice", json.dumps(list(options)), field_name)

    @classmethod
    def grammar(cls, source: str, field_name: str = DEFAULT_FIELD) -> GrammarSpec:
        """A context-free grammar: Lark syntax, or GBNF (``root ::= ...``)."""
        if not isinstance(source, str):
            raise GenerationConfigError(
                field_name, f"a grammar must be a string, got {type(source).__name__}"
            )
        return cls("grammar", source, field_name)
