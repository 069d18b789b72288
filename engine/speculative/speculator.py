"""Proposing drafts and counting what verification accepts.

After each step the engine asks ``propose`` for the drafts of the running sequences that speculate: each
decoding sequence gets up to its draft length (``DraftLength``: the seeds' ``num_assistant_tokens_schedule``)
from its method, and the scheduler verifies them in the next step. With more than ``disable_by_batch_size``
running requests nobody drafts: the step is compute-bound and verifying would cost more than it saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.generation.speculation import MAX_SPECULATIVE_TOKENS, DraftLength
from engine.speculative.config import DEFAULT_DISABLE_BY_BATCH_SIZE
from engine.speculative.ngram import propose_ngram
from scheduler.request import Request


@dataclass
class SpecDecodeStats:
    """Totals since start (vLLM's ``spec_decode_*`` counters)."""

    num_drafts: int = 0  # verify chunks
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify chunk yields on average: its accepted drafts plus the token sampled after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    """The drafts of each step's speculating sequences; ``stats`` counts their fate."""

    def __init__(self, disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE) -> None:
        self.disable_by_batch_size = disable_by_batch_size
        self.stats = SpecDecodeStats()

    def propose(self, running: Sequence[Request]) -> None:
        """Set ``draft_ids`` on the running requests that decode and speculate."""
        if len(running) > self.disable_by_batch_size:
            return
        for req in running:
            speculation = req.payload.group.speculation
            if speculation is None or req.num_uncomputed_tokens != 1 or req.wants_prompt_logits:
                continue
            seq = req.payload
            if seq.draft_length is None:
                seq.draft_length = DraftLength(speculation)
            num_tokens = min(seq.draft_length.value, req.max_new_tokens - len(req.output_ids) - 1)
            if num_tokens < 1:
                continue
            req.draft_ids = propose_ngram(
                req.all_token_ids, speculation.prompt_lookup_min, speculation.prompt_lookup_max, num_tokens
            )

    def record(self, draft_length: DraftLength | None, num_drafts: int, num_accepted: int) -> None:
        """A verify chunk's outcome: counted, and its sequence's draft length adapted."""
        self.stats.record(num_drafts, num_accepted)
        if draft_length is not None:
            draft_length.update(num_drafts, num_accepted)
