"""The engine's one call per step: processed logits -> one token per row (+ logprobs).

Greedy rows (``do_sample`` off or temperature 0) take the argmax of their processed logits (on the CPU one C
pass gives every row's maximum and argmax: engine/generation/row_argmax.py). Sampled rows
draw by inverse CDF: one uniform ``u`` from the row's ``RequestRNG`` (a pure function of seed, sample
index and token index), then the first token whose cumulative probability (vocabulary order, float64)
exceeds ``u``. Nothing depends on the other rows of the batch, so a seeded request is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.cpu.native_build import KernelUnavailable
from engine.errors import UnsatisfiableOptionsError
from engine.generation.grammar_mask import apply_grammar_masks, compute_grammar_masks
from engine.generation.logprobs import compute_logprobs
from engine.generation.mask_prefetch import MaskPrefetcher, PendingMasks
from engine.generation.processors import apply_logits_processors, processes
from engine.generation.rng import RequestRNG
from engine.generation.row_argmax import RowArgmax
from engine.generation.row_argmax import load as load_row_argmax
from engine.generation.rows import SampledToken, SamplingRow
from engine.generation.user_processors import (
    PROCESSOR_FAILED,
    BatchedLogitsProcessor,
    ProcessorRow,
    apply_request_processors,
    apply_server_processors,
)
from engine.outputs import TokenLogprob

__all__ = ["SampledToken", "Sampler", "SamplingRow"]


ARGMAX_BLOCK = 1024


def block_maxima(logits: torch.Tensor) -> torch.Tensor:
    """The maxima of each row's blocks of ``ARGMAX_BLOCK`` columns (the last one shorter where the vocabulary
    is not a multiple), ``[R, ceil(V / ARGMAX_BLOCK)]``, in one vectorised pass. NaN propagates, so their
    maximum is exactly ``logits.amax(dim=1)``: the sampler reads both its dead rows and its greedy picks
    from them."""
    num_rows, vocab = logits.shape
    whole = vocab // ARGMAX_BLOCK
    parts: list[torch.Tensor] = []
    if whole:
        parts.append(logits[:, : whole * ARGMAX_BLOCK].view(num_rows, whole, ARGMAX_BLOCK).amax(dim=2))
    if vocab > whole * ARGMAX_BLOCK:
        parts.append(logits[:, whole * ARGMAX_BLOCK :].amax(dim=1, keepdim=True))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [R, blocks]


def argmax_rows(logits: torch.Tensor, block_max: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(dim=1)``, the first index of each row's maximum, for rows without NaN, in two cheap
    passes: PyTorch's CPU argmax (an index-tracking reduction) is not vectorised, ``amax`` is (measured:
    docs/benchmarks-log.md, session 8). The rows' ``block_maxima`` (computed here when not given), the first
    block holding the row's maximum, then argmax inside that block alone."""
    vocab = logits.shape[1]
    if vocab < 2 * ARGMAX_BLOCK:
        return logits.argmax(dim=1)
    if block_max is None:
        block_max = block_maxima(logits)  # [R, blocks]
    row_max = block_max.amax(dim=1, keepdim=True)  # [R, 1]
    start = (block_max == row_max).to(torch.uint8).argmax(dim=1) * ARGMAX_BLOCK  # [R]: its first block
    # NOTE: in a shorter last block the clamped columns repeat the last one, after it: argmax stays first.
    columns = (start[:, None] + torch.arange(ARGMAX_BLOCK, device=logits.device)).clamp_(max=vocab - 1)
    return start + logits.gather(1, columns).argmax(dim=1)  # [R]


def row_maxima(logits: torch.Tensor, kernel: RowArgmax | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum, ``[R]`` (NaN where the row holds a NaN, as ``amax``), and the first column that
    holds it, ``[R]`` (``argmax``; meaningless for a row with a NaN): from ``kernel`` where it reads these
    logits, else by ``block_maxima`` and ``argmax_rows``."""
    if kernel is not None and kernel.takes(logits):
        return kernel(logits)
    block_max = block_maxima(logits)  # [R, blocks]
    return block_max.amax(dim=1), argmax_rows(logits, block_max)


class Sampler:
    """``sample(logits [R, V] float32, rows) -> list[SampledToken]``, one per row, in order.

    ``eos_token_ids``: the model's EOS ids, used by min_new_tokens masking and bad_words filtering for
    rows that name none (``SamplingRow.eos_token_ids`` or ``config.eos_token_id``).
    ``logits_processors``: the server's processors, by name (engine/generation/user_processors.py), for
    the rows whose config has ``logits_processor_args``. ``row_argmax``: on the CPU, each row's maximum and
    argmax from the C pass where it builds (off: the PyTorch path, for comparisons).
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: Sequence[int] = (),
        logits_processors: Sequence[tuple[str, BatchedLogitsProcessor]] = (),
        row_argmax: bool = True,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)
        self.logits_processors = tuple(logits_processors)
        self._masks = MaskPrefetcher(vocab_size, self.eos_token_ids)
        self._row_argmax: RowArgmax | None = None
        if row_argmax and self.device.type == "cpu":
            try:
                self._row_argmax = load_row_argmax()
            except KernelUnavailable:
                pass  # the PyTorch path (row_maxima) instead

    @property
    def has_row_argmax(self) -> bool:
        """Whether this sampler's rows take the C pass (``row_argmax`` asked for, a CPU, a kernel built)."""
        return self._row_argmax is not None

    def masks_ahead(self, rows: Sequence[SamplingRow]) -> PendingMasks:
        """Start the grammar masks of ``rows`` on a worker thread, for ``sample`` to collect
        (engine/generation/mask_prefetch.py). Use it as a context manager around the forward."""
        return self._masks.start(rows)

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], masks: PendingMasks | None = None
    ) -> list[SampledToken]:
        """One token per row of ``logits [R, V]``; ``masks``: the rows' grammar masks from ``masks_ahead``
        (computed here when not given)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [{len(rows)}, vocab], got {tuple(logits.shape)}")
        if not rows:
            return []
        # NOTE: the model may pad its vocabulary past the tokenizer's; those columns can never be chosen.
        logits = logits[:, : self.vocab_size].float()  # [R, V]
        errors: list[str | None] = [None] * len(rows)
        # NOTE: a row's maximum is NaN where any of its logits is and +inf where any is: the pass that finds
        # the greedy argmax tells the broken rows too. -inf is a token the model rules out (DoLa's contrast
        # does: engine/executor/dola.py); a row of them only is caught below with the other rows that leave
        # no token.
        row_max, first = row_maxima(logits, self._row_argmax)  # [R], [R]
        maxima = row_max.tolist()  # read once as a list (R is small)
        bad = [m != m or m == math.inf for m in maxima]  # NaN or +inf
        for i, is_bad in enumerate(bad):
            if is_bad:
                errors[i] = "the model produced NaN or infinite logits for this sequence"
        codes: list[str | None] = [None] * len(rows)
        processed = self._processed(logits, rows, masks, bad, errors, codes)
        if processed is not None:
            logits = processed
            row_max, first = row_maxima(processed, self._row_argmax)  # [R], [R], of the processed logits
            maxima = row_max.tolist()

        # Every token masked (max -inf), or a penalty that pushed a logit to +inf or NaN: the request's
        # options did it.
        dead = [not math.isfinite(m) for m in maxima]
        for i, is_dead in enumerate(dead):
            if is_dead and errors[i] is None:
                errors[i] = (
                    "the generation options leave no token that can be sampled (every token masked, or a "
                    "penalty that overflows the logits)"
                )
                codes[i] = UnsatisfiableOptionsError.code

        tokens = self._pick(logits, first, rows, errors)
        logprobs = self._logprobs(logits, rows, errors, tokens)
        return [
            SampledToken(token_id=-1, error=errors[i], error_code=codes[i])
            if errors[i] is not None
            else SampledToken(token_id=tokens[i], logprob=logprobs.get(i))
            for i in range(len(rows))
        ]

    def _processed(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        masks: PendingMasks | None,
        bad: list[bool],
        errors: list[str | None],
        codes: list[str | None],
    ) -> torch.Tensor | None:
        """A copy of ``logits`` with the broken rows neutralised, the grammar masks, cbserve's processors and
        the user's applied; None where none of them writes (plain greedy rows: the caller's logits stay as
        they are, and no copy of ``[R, V]`` float32 is made)."""
        grammar = masks.result() if masks is not None else None
        if grammar is None and any(row.grammar is not None for row in rows):
            grammar = compute_grammar_masks(rows, self.vocab_size, self.eos_token_ids)
        if not (any(bad) or grammar is not None or any(self._processes(row) for row in rows)):
            return None
        logits = logits.clone()
        if any(bad):  # neutral values keep a broken row from producing warnings or NaNs in shared ops
            logits[torch.tensor(bad, device=logits.device)] = 0.0
        if grammar is not None:
            apply_grammar_masks(logits, grammar, errors)
        apply_logits_processors(
            logits, rows, self.eos_token_ids, lambda lg: self._apply_user_processors(lg, rows, errors, codes)
        )
        return logits

    def reads_logits_only(self, row: SamplingRow) -> bool:
        """Whether ``row``'s token (and logprobs) is a function of its logits alone: a greedy row without a
        grammar or a processor. Such a sequence's rows at successive positions can be sampled at once."""
        return row.config.is_greedy and row.grammar is None and not self._processes(row)

    def _processes(self, row: SamplingRow) -> bool:
        """Whether the processors, cbserve's or the user's, may change ``row``'s logits."""
        return (
            processes(row)
            or row.hooks is not None
            or (bool(self.logits_processors) and row.config.logits_processor_args is not None)
        )

    def _apply_user_processors(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        errors: list[str | None],
        codes: list[str | None],
    ) -> None:
        """The server's processors, then each request's own, over ``logits`` in place; a row they fail
        gets its error and the code ``logits_processor_failed``."""
        failed_before = [e is not None for e in errors]
        if self.logits_processors:
            server_rows = [
                None
                if r.config.logits_processor_args is None
                else ProcessorRow(r.prompt_ids, r.output_ids, r.config.logits_processor_args)
                for r in rows
            ]
            apply_server_processors(logits, self.logits_processors, server_rows, errors)
        if any(r.hooks is not None for r in rows):
            apply_request_processors(
                logits, [r.hooks for r in rows], lambda i: [*rows[i].prompt_ids, *rows[i].output_ids], errors
            )
        for i, before in enumerate(failed_before):
            if not before and errors[i] is not None:
                codes[i] = PROCESSOR_FAILED

    def _pick(
        self,
        logits: torch.Tensor,
        first: torch.Tensor,
        rows: Sequence[SamplingRow],
        errors: list[str | None],
    ) -> list[int]:
        """The next token of every row without an error (-1 for the others): greedy rows their argmax
        (``first``, from ``row_maxima``), sampling rows by their own draws."""
        tokens = [-1] * len(rows)
        greedy = [i for i, r in enumerate(rows) if r.config.is_greedy and errors[i] is None]
        sampled = [i for i, r in enumerate(rows) if not r.config.is_greedy and errors[i] is None]
        if greedy:
            argmax = first.tolist()
            for i in greedy:
                tokens[i] = int(argmax[i])
        if sampled:
            for i, t in zip(sampled, self._sample_rows(logits, rows, sampled), strict=True):
                tokens[i] = t
        return tokens

    def _logprobs(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], errors: list[str | None], tokens: list[int]
    ) -> dict[int, TokenLogprob]:
        """Logprobs of the chosen tokens (and the top alternatives) for the rows that asked for them."""
        want = [i for i, r in enumerate(rows) if r.config.output_logprobs and errors[i] is None]
        if not want:
            return {}
        w = torch.tensor(want, dtype=torch.int64, device=logits.device)
        lps = compute_logprobs(
            logits.index_select(0, w),
            [tokens[i] for i in want],
            [rows[i].config.top_logprobs for i in want],
        )
        return dict(zip(want, lps, strict=True))

    def _sample_rows(self, logits: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> list[int]:
        """Inverse-CDF draws for rows ``idx`` with their own uniforms."""
        uniforms: list[float] = []
        for i in idx:
            row = rows[i]
            rng = row.rng if row.rng is not None else RequestRNG(row.config.seed)
            uniforms.append(rng.uniform(row.num_output_tokens))
        sel = torch.tensor(idx, dtype=torch.int64, device=logits.device)
        probs = torch.softmax(logits.index_select(0, sel), dim=-1)  # [S, V]
        cdf = probs.double().cumsum(dim=-1)  # [S, V]
        u = torch.tensor(uniforms, dtype=torch.float64, device=logits.device).unsqueeze(1)  # [S, 1]
        # first index with cdf > u * total: a token of zero probability never gets picked (right=True)
        total = cdf[:, -1:]  # [S, 1], ~1
        # NOTE: u * total can round up to total; stay strictly below it so the draw lands on a real token.
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        chosen = torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[1] - 1)  # [S, 1]
        return [int(t) for t in chosen.squeeze(1).tolist()]
