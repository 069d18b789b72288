"""JSON schemas whose grammars blow up, shared by the compiler's tests (tests/engine/test_grammar.py) and
the server's (tests/reliability/test_reliability_grammar.py)."""

from __future__ import annotations

from typing import Any


def nested_schema(depth: int) -> dict[str, Any]:
    """An object nested ``depth`` levels deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def all_of_choices(count: int) -> dict[str, Any]:
    """Every one of ``count`` two-way choices at once: the grammar multiplies them out."""
    return {
        "allOf": [
            {
                "anyOf": [
                    {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]},
                    {"type": "object", "properties": {f"j{i}": {"type": "string"}}, "required": [f"j{i}"]},
                ]
            }
            for i in range(count)
        ]
    }
