"""One request's speculative decoding: how it drafts (``Speculation``, resolved at admission from its
options and the server's, engine/speculative/config.py) and how many drafts a step (``DraftLength``)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_SPECULATIVE_TOKENS = 16
SCHEDULES = ("heuristic", "constant")  # transformers' ``num_assistant_tokens_schedule`` values we follow
# transformers' prompt lookup default (``max_matching_ngram_size``)
DEFAULT_MAX_MATCHING_NGRAM_SIZE = 2


@dataclass(frozen=True)
class Speculation:
    """One request's speculation, resolved at admission: how it drafts and how many tokens at most."""

    method: str
    num_tokens: int  # the most drafts per step (the heuristic schedule starts here and never goes past it)
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = DEFAULT_MAX_MATCHING_NGRAM_SIZE
    schedule: str = "heuristic"
    num_layers: int | None = None  # early_exit: the layers that draft
    confidence_threshold: float = 0.0  # early_exit: stop drafting below this probability of the draft


def default_schedule(method: str) -> str:
    """The draft-length schedule of a request whose options and server name none. Prompt lookup drafts its
    most tokens every step, as transformers' prompt lookup does: its drafts cost a verify row each, not a
    forward, and a draft length cut after a miss costs the next good match its tokens (on the grounded
    workload, 2.19 tokens a verify step constant against 2.00 heuristic: docs/BENCHMARKS.md). A model that
    drafts pays a forward a draft: it adapts (``"heuristic"``)."""
    return "constant" if method == "ngram" else "heuristic"


class DraftLength:
    """A sequence's number of drafts per step. ``"heuristic"`` (transformers' schedule, bounded by the
    request's maximum): +2 after a step that accepted every draft, -1 (not below 1) after one that did not;
    ``"constant"``: always the maximum."""

    def __init__(self, speculation: Speculation) -> None:
        self.maximum = speculation.num_tokens
        self.heuristic = speculation.schedule == "heuristic"
        self.value = self.maximum

    def update(self, num_drafts: int, num_accepted: int) -> None:
        if not self.heuristic or num_drafts == 0:
            return
        if num_accepted == num_drafts:
            self.value = min(self.value + 2, self.maximum)
        else:
            self.value = max(self.value - 1, 1)
