"""A request's structured-output fields -> the engine's ``GrammarSpec`` (engine/generation/grammar_spec.py).

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with ``json_schema.schema``) and
vLLM's ``structured_outputs: {json | regex | choice | grammar | json_object}`` and older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``. At most one may constrain a request. Each spec
names the field it came from, so a spec the grammar library rejects at admission is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.generation.config import GenerationConfigError
from engine.generation.grammar_spec import GrammarSpec
from server.errors import APIError
from server.schemas import SamplingRequest


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", param=field, code="invalid_value")


def _response_format(req: SamplingRequest) -> list[GrammarSpec]:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [GrammarSpec.json_object("response_format")]
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise _bad("response_format.json_schema.schema", "a json_schema response format needs a schema")
    return [GrammarSpec.json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")]


_KINDS: dict[str, Callable[[Any, str], GrammarSpec]] = {
    "json": GrammarSpec.json_schema,
    "regex": GrammarSpec.regex,
    "choice": GrammarSpec.choice,
    "grammar": GrammarSpec.grammar,
}


def _vllm_fields(req: SamplingRequest) -> list[GrammarSpec]:
    specs: list[GrammarSpec] = []
    so = req.structured_outputs
    if so is not None:
        values = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        for kind, value in values.items():
            if value is not None:
                specs.append(_KINDS[kind](value, f"structured_outputs.{kind}"))
        if so.json_object:
            specs.append(GrammarSpec.json_object("structured_outputs.json_object"))
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice}
    guided["grammar"] = req.guided_grammar
    for kind, value in guided.items():
        if value is not None:
            specs.append(_KINDS[kind](value, f"guided_{kind}"))
    return specs


def structured_output_spec(req: SamplingRequest) -> GrammarSpec | None:
    """The request's output constraint, if any; ``APIError`` (400 naming the field) when a value is
    malformed or two fields constrain it at once."""
    try:
        specs = _response_format(req) + _vllm_fields(req)
    except GenerationConfigError as exc:
        raise _bad(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from exc
    if len(specs) > 1:
        raise _bad(specs[1].field, f"only one structured output may be given, and {specs[0].field} is too")
    return specs[0] if specs else None
