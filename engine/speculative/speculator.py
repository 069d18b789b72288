"""Proposing drafts and counting what verification accepts.

After each step the engine asks ``propose`` for the drafts of the running sequences that speculate: each
decoding sequence gets up to its draft length (``DraftLength``: the seeds' ``num_assistant_tokens_schedule``)
from its method (prompt lookup: ngram.py; the model's first layers or a draft model, one decode row per
position: early_exit.py), and the scheduler verifies them in the next step. With more than ``disable_by_batch_size``
running requests nobody drafts: the step is compute-bound and verifying would cost more than it saves.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.generation.speculation import MAX_SPECULATIVE_TOKENS, DraftLength, Speculation
from engine.speculative.config import DEFAULT_DISABLE_BY_BATCH_SIZE
from engine.speculative.early_exit import EarlyExitProposer
from engine.speculative.ngram import NgramIndex, word_start_ids
from scheduler.request import Request

logger = logging.getLogger(__name__)


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

    def __init__(
        self,
        disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE,
        early_exit: EarlyExitProposer | None = None,
        draft_model: EarlyExitProposer | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.disable_by_batch_size = disable_by_batch_size
        self.early_exit = early_exit  # None: the model cannot draft with its first layers
        self.draft_model = draft_model  # None: no draft model is loaded
        self.tokenizer = tokenizer  # None: prompt lookup resumes a copy at the next token, not the next word
        self.stats = SpecDecodeStats()
        # NOTE: by request (its identity: a client may use a request id again), the running ones only: a
        # request that stops running (finished, cancelled, preempted) drops its index, and builds it anew
        # when it runs again.
        self._ngram_indexes: dict[Request, NgramIndex] = {}

    def propose(self, running: Sequence[Request]) -> list[tuple[Request, str]]:
        """Set ``draft_ids`` on the running requests that decode and speculate. Returns the requests whose
        proposer failed, and why: the engine fails them, and only them."""
        if len(running) > self.disable_by_batch_size:
            self._ngram_indexes.clear()
            return []
        self._ngram_indexes = {req: self._ngram_indexes[req] for req in running if req in self._ngram_indexes}
        wanted: dict[str, list[tuple[Request, int, Speculation]]] = {"early_exit": [], "draft_model": []}
        for req in running:
            speculation: Speculation | None = req.payload.group.speculation
            if speculation is None or req.num_uncomputed_tokens != 1 or req.wants_prompt_logits:
                continue
            num_tokens = min(
                self._draft_length(req, speculation), req.max_new_tokens - len(req.output_ids) - 1
            )
            if num_tokens < 1:
                continue
            if speculation.method == "ngram":
                req.draft_ids = self._ngram_index(req, speculation).propose(num_tokens)
            else:
                wanted[speculation.method].append((req, num_tokens, speculation))
        failed: list[tuple[Request, str]] = []
        for method, proposer in (("early_exit", self.early_exit), ("draft_model", self.draft_model)):
            if not wanted[method] or proposer is None:
                continue
            try:
                drafts = proposer.propose(wanted[method])
            except Exception as exc:  # NOTE: a failing draft forward fails the requests it drafted for.
                logger.exception("the %s proposer failed", method)
                failed.extend(
                    (req, f"speculative decoding ({method}) failed: {exc!r}") for req, _, _ in wanted[method]
                )
                continue
            for req, _, _ in wanted[method]:
                req.draft_ids = drafts.get(req.request_id, [])
        for req in running:
            grammar = req.payload.gen.grammar
            if req.draft_ids and grammar is not None:  # a constrained output: drafts the grammar allows only
                del req.draft_ids[grammar.valid_prefix(req.draft_ids) :]
        return failed

    @staticmethod
    def _draft_length(req: Request, speculation: Speculation) -> int:
        seq = req.payload
        if seq.draft_length is None:
            seq.draft_length = DraftLength(speculation)
        return int(seq.draft_length.value)

    def _ngram_index(self, req: Request, speculation: Speculation) -> NgramIndex:
        """The request's n-gram index, brought up to its tokens (built at its first proposal)."""
        index = self._ngram_indexes.get(req)
        if index is None:
            words = word_start_ids(self.tokenizer) if self.tokenizer is not None else None
            index = self._ngram_indexes[req] = NgramIndex(
                speculation.prompt_lookup_min, speculation.prompt_lookup_max, words
            )
        index.update(req.prompt_ids, req.output_ids)
        return index

    def record(self, draft_length: DraftLength | None, num_drafts: int, num_accepted: int) -> None:
        """A verify chunk's outcome: counted, and its sequence's draft length adapted."""
        self.stats.record(num_drafts, num_accepted)
        if draft_length is not None:
            draft_length.update(num_drafts, num_accepted)
