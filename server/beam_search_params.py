"""Beam search over HTTP: vLLM's fields (``use_beam_search`` with ``best_of`` beams, ``n`` returned,
``length_penalty``, ``early_stopping``) and transformers' ``num_beams``, ``num_beam_groups`` and
``diversity_penalty`` (diverse beam search) and ``force_words_ids`` (constrained beam search) as extras, into the engine's beam-search options
(engine/beam_group.py).

Rules:
- a request searches with beams when ``use_beam_search`` is true (``best_of`` beams, else ``num_beams``,
  else ``n``) or ``num_beams`` > 1; ``n`` of the best hypotheses are returned, best first;
- ``n`` > the number of beams, ``best_of`` and ``num_beams`` that disagree, and beams with ``stream: true``
  (a search publishes its sequences only once it is over; OpenAI's stream has no way to take back text)
  are 400s naming the field;
- without beams, ``best_of`` other than ``n`` (cbserve returns every sample it generates),
  ``length_penalty`` other than 1, ``early_stopping``, ``num_beam_groups``, ``diversity_penalty`` and
  ``force_words_ids`` are 400s: they would change nothing;
- beams are deterministic unless the request sets a ``temperature`` > 0 (then beam sampling).
"""

from __future__ import annotations

from typing import Any

from server.errors import APIError
from server.schemas import SamplingRequest


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _beam_field(req: SamplingRequest) -> str | None:
    """The field that asks for beams, or None."""
    if req.use_beam_search:
        return "use_beam_search"
    if req.num_beams is not None and req.num_beams > 1:
        return "num_beams"
    return None


def _refuse_beam_fields_without_beams(req: SamplingRequest) -> None:
    why = "applies only to beam search (use_beam_search: true, or num_beams > 1)"
    if req.best_of is not None and req.best_of != req.n:
        raise _invalid("best_of", f"{why}; without it cbserve returns every sample it generates: ask for n")
    if req.length_penalty is not None and req.length_penalty != 1:
        raise _invalid("length_penalty", why)
    if req.early_stopping is not None and req.early_stopping is not False:
        raise _invalid("early_stopping", why)
    if req.num_beam_groups is not None and req.num_beam_groups != 1:
        raise _invalid("num_beam_groups", why)
    if req.diversity_penalty is not None and req.diversity_penalty != 0:
        raise _invalid("diversity_penalty", why)
    if req.force_words_ids is not None:
        raise _invalid("force_words_ids", why)


def beam_search_options(req: SamplingRequest) -> dict[str, Any]:
    """The engine options of ``req``'s beam search (none without beams); raises ``APIError`` (400)."""
    field = _beam_field(req)
    if field is None:
        _refuse_beam_fields_without_beams(req)
        return {}
    if req.stream:
        raise _invalid(
            field, "beam search returns its sequences once the search is over: not with stream: true"
        )
    if req.best_of is not None and req.num_beams is not None and req.best_of != req.num_beams:
        raise _invalid("num_beams", f"({req.num_beams}) disagrees with best_of ({req.best_of})")
    num_beams = req.best_of or req.num_beams or req.n
    if req.n > num_beams:
        named = "best_of" if req.best_of is not None else "num_beams" if req.num_beams is not None else "n"
        raise _invalid(named, f"n ({req.n}) must not exceed the number of beams ({num_beams})")
    return {
        "num_beams": num_beams,
        "length_penalty": req.length_penalty,
        "early_stopping": req.early_stopping,
        "num_beam_groups": req.num_beam_groups,
        "diversity_penalty": req.diversity_penalty,
        "force_words_ids": req.force_words_ids,
        "do_sample": req.temperature is not None and req.temperature > 0,
    }
