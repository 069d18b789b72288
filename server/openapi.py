"""The published OpenAPI document (``/openapi.json``) with standard JSON Schema bounds.

pydantic publishes the bounds of a ``Field(ge=..., le=...)`` over a type with a before-validator (the
request schemas' ``Number``: a JSON number, nothing coerced) as its own ``ge``/``gt``/``le``/``lt`` keys,
which JSON Schema does not know: clients and fuzzers read such a field as unbounded. They are renamed to
``minimum``/``exclusiveMinimum``/``maximum``/``exclusiveMaximum`` (OpenAPI 3.1: numbers, not flags).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

JSON_SCHEMA_BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}
NUMERIC_TYPES = ("number", "integer")


def publish_standard_bounds(app: FastAPI) -> None:
    """Make ``app.openapi()`` (what ``/openapi.json`` serves) rename pydantic's bound keys, once."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()  # NOTE: FastAPI caches it; renaming twice changes nothing
        rename_bounds(schema)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def rename_bounds(node: Any) -> None:
    """Rename the bound keys of every numeric schema under ``node``, in place."""
    if isinstance(node, dict):
        if node.get("type") in NUMERIC_TYPES:
            for key, standard in JSON_SCHEMA_BOUNDS.items():
                if key in node:
                    node[standard] = node.pop(key)
        for value in node.values():
            rename_bounds(value)
    elif isinstance(node, list):
        for value in node:
            rename_bounds(value)
