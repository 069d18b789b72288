"""Loading the server's logits processors (``cbserve serve --logits-processors SPEC [SPEC ...]``).

A spec is ``package.module:Class`` or the name of an entry point in the group
``cbserve.logits_processors`` (a package declares ``[project.entry-points."cbserve.logits_processors"]
name = "package.module:Class"``). Each class is built once, with ``Class(tokenizer, vocab_size)``, and its
instance must take ``(rows, logits)`` (engine/generation/user_processors.py). Everything is checked at
start: a spec that does not import, is not a class, fails to build or has another call signature raises
``ProcessorLoadError`` with the reason, and the server does not start.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Sequence
from typing import Any

from engine.generation.user_processors import BatchedLogitsProcessor

ENTRY_POINT_GROUP = "cbserve.logits_processors"


class ProcessorLoadError(ValueError):
    """A ``--logits-processors`` spec that cannot be used; the message names it and says why."""


def load_logits_processors(
    specs: Sequence[str], tokenizer: Any, vocab_size: int
) -> list[tuple[str, BatchedLogitsProcessor]]:
    """Each spec's processor, built and checked, with the spec as its name (in the given order)."""
    if len(set(specs)) != len(specs):
        raise ProcessorLoadError(f"a logits processor is named twice in {list(specs)}")
    return [(spec, _build(spec, resolve_logits_processor(spec), tokenizer, vocab_size)) for spec in specs]


def resolve_logits_processor(spec: str) -> Any:
    """The object a spec names: ``module:attr`` imported, or an entry point loaded (not built yet: the
    command line checks this before the model loads)."""
    if ":" not in spec:
        return _entry_point(spec)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ProcessorLoadError(f"{spec!r}: expected 'package.module:Class'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ProcessorLoadError(f"{spec!r}: cannot import {module_name!r}: {exc!r}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ProcessorLoadError(f"{spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _entry_point(name: str) -> Any:
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    matches = [ep for ep in found if ep.name == name]
    if not matches:
        known = ", ".join(sorted(ep.name for ep in found)) or "none installed"
        raise ProcessorLoadError(
            f"{name!r}: not 'package.module:Class', and no entry point of that name in the group "
            f"{ENTRY_POINT_GROUP!r} ({known})"
        )
    try:
        return matches[0].load()
    except Exception as exc:
        raise ProcessorLoadError(
            f"{name!r}: entry point {matches[0].value!r} fails to load: {exc!r}"
        ) from exc


def _build(spec: str, cls: Any, tokenizer: Any, vocab_size: int) -> BatchedLogitsProcessor:
    if not isinstance(cls, type):
        raise ProcessorLoadError(f"{spec!r}: names {cls!r}, not a class")
    try:
        instance = cls(tokenizer, vocab_size)
    except Exception as exc:
        raise ProcessorLoadError(f"{spec!r}: {cls.__name__}(tokenizer, vocab_size) failed: {exc!r}") from exc
    if not callable(instance):
        raise ProcessorLoadError(f"{spec!r}: {cls.__name__} has no __call__(rows, logits)")
    try:
        signature = inspect.signature(instance)
    except (TypeError, ValueError):  # NOTE: a callable Python cannot introspect: its call will tell.
        return instance  # type: ignore[no-any-return]
    try:
        signature.bind([], None)
    except TypeError:
        raise ProcessorLoadError(
            f"{spec!r}: {cls.__name__}.__call__ must take (rows, logits), not {signature}"
        ) from None
    return instance  # type: ignore[no-any-return]
