"""The error a request's generation options raise (config validation, grammar compilation)."""

from __future__ import annotations


class GenerationConfigError(ValueError):
    """An option value, or a combination of them, that cannot work. ``field`` names the option."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


class GrammarTooComplexError(GenerationConfigError):
    """A structured output (schema, regex, grammar) past the grammar library's limits, or not compiled
    within the time allowed: HTTP 400, the message saying it is too complex."""
