"""Grammar masks computed while the forward runs.

A step's masks depend only on each matcher's state, which the previous step's tokens fixed, not on this
step's logits: so the engine starts them on a worker thread before the forward and the sampler collects
them after it, as vLLM and SGLang overlap them. llguidance computes a mask in Rust without holding the GIL
and the forward's ops release it too, so the two run side by side; a step without constrained rows starts
nothing.

    with sampler.masks_ahead(rows) as masks:        # starts compute_grammar_masks on the worker
        logits = executor.execute(batch)
        tokens = sampler.sample(logits, rows, masks)  # waits for them, then applies them
    # leaving the block waits too: no matcher is read once the step is over, even when the forward raised
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from engine.generation.grammar_mask import GrammarMasks, compute_grammar_masks
from engine.generation.rows import SamplingRow


class PendingMasks:
    """The masks of one step's rows, being computed (or ``None`` for a step without constraints)."""

    def __init__(self, future: Future[GrammarMasks] | None) -> None:
        self._future = future

    def result(self) -> GrammarMasks | None:
        """Wait for the masks. A failure of the computation itself (not of one matcher, which
        ``GrammarMasks.errors`` records) is raised here, on the engine thread."""
        return None if self._future is None else self._future.result()

    def __enter__(self) -> PendingMasks:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._future is not None:
            self._future.exception()  # NOTE: waits without raising: the step's own error (if any) wins.


class MaskPrefetcher:
    """Starts ``compute_grammar_masks`` for a step's rows on one worker thread (created at the first
    constrained step)."""

    def __init__(self, vocab_size: int, default_eos: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self.default_eos = default_eos
        self._pool: ThreadPoolExecutor | None = None

    def start(self, rows: Sequence[SamplingRow]) -> PendingMasks:
        if not any(row.grammar is not None for row in rows):
            return PendingMasks(None)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cbserve-grammar-masks")
        return PendingMasks(
            self._pool.submit(compute_grammar_masks, list(rows), self.vocab_size, self.default_eos)
        )
