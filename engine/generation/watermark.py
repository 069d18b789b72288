"""The watermark processors, the last of the pipeline (transformers applies its watermark after every
other processor and warper): each row with ``config.watermarking_config`` gets transformers'
``WatermarkLogitsProcessor`` or ``SynthIDTextWatermarkLogitsProcessor`` result for its own tokens; the
other rows are not touched.

transformers' processor sees ``input_ids``, the prompt and the tokens generated so far, and SynthID's
keeps a state from call to call. Here a row's state is rebuilt from its tokens at each step (the context
is the last ``ngram_len - 1`` generated tokens, zeros before the first; the repeated-context history the
hashes of the contexts of its last ``context_history_size`` watermarked steps, zeros where there were
fewer), so a row needs nothing carried between steps and survives preemption and recompute as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.generation.rows import SamplingRow
from engine.generation.watermark_config import GreenlistWatermark, SynthIDWatermark
from engine.generation.watermark_hash import (
    SELFHASH_CANDIDATES,
    context_hashes,
    g_values,
    greenlist_ids,
    is_green,
)

# SynthID computes [rows, V, depth] int64 g-values: as many rows at a time as keep that near 32 MB.
SYNTHID_CHUNK_ELEMENTS = 1 << 22


def _last_tokens(row: SamplingRow, count: int) -> list[int]:
    """The last ``count`` tokens of the row's prompt and output (fewer when it has fewer)."""
    out = list(row.output_ids[-count:]) if count else []
    if len(out) < count:
        need = count - len(out)
        out = list(row.prompt_ids[-need:]) + out
    return out


# ---------------------------------------------------------------------------------------- green lists
def _green_tokens(config: GreenlistWatermark, row: SamplingRow, row_logits: torch.Tensor) -> list[int]:
    """The tokens of one row that get the bias (none while the row holds fewer than ``context_width``
    tokens, as transformers skips the step)."""
    width = config.context_width
    context = _last_tokens(row, width)
    if len(context) < width:
        return []
    vocab = row_logits.shape[0]
    if config.seeding_scheme == "lefthash":
        return greenlist_ids(config, vocab, context).tolist()
    # NOTE: transformers sorts the whole row (not topk) to pick the candidates; ties keep its order.
    candidates = row_logits.sort(dim=-1, descending=True).indices[:SELFHASH_CANDIDATES].tolist()
    # the candidate's own green list: seeded with it as the newest of ``context_width`` tokens
    return [c for c in candidates if is_green(config, vocab, [*context[1:], c], c)]


def apply_greenlist_watermark(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """``logits[row, green] += bias`` for every row with a ``GreenlistWatermark``, in one op."""
    r_idx: list[int] = []
    t_idx: list[int] = []
    vals: list[float] = []
    for i, row in enumerate(rows):
        config = row.config.watermarking_config
        if not isinstance(config, GreenlistWatermark):
            continue
        green = _green_tokens(config, row, logits[i])
        r_idx.extend([i] * len(green))
        t_idx.extend(green)
        vals.extend([config.bias] * len(green))
    if not r_idx:
        return
    dev = logits.device
    logits.index_put_(
        (
            torch.tensor(r_idx, dtype=torch.int64, device=dev),
            torch.tensor(t_idx, dtype=torch.int64, device=dev),
        ),
        torch.tensor(vals, dtype=logits.dtype, device=dev),
        accumulate=True,
    )


# ---------------------------------------------------------------------------------------- SynthID
def synthid_context(config: SynthIDWatermark, output_ids: Sequence[int]) -> list[int]:
    """The ``ngram_len - 1`` tokens that seed the next token's g-values: the last generated ones, zeros
    in front while fewer were generated (transformers' state starts from zeros)."""
    width = config.ngram_len - 1
    padded = [0] * width + list(output_ids[-width:])
    return padded[-width:]


def _is_repeated_context(config: SynthIDWatermark, output_ids: Sequence[int], context_hash: int) -> bool:
    """Whether the context was seen within the row's last ``context_history_size`` watermarked steps.

    Step ``k`` (1-based, the generated token ``k``) has the context ``padded[k - 1 : k - 1 + ngram_len - 1]``
    of ``padded = zeros(ngram_len - 1) + output``; skipped steps (``skip_first_ngram_calls``) are not
    recorded, and the history starts as zeros."""
    width = config.ngram_len - 1
    step = len(output_ids) + 1
    first = config.ngram_len if config.skip_first_ngram_calls else 1
    num_recorded = step - first
    if num_recorded < config.context_history_size and context_hash == 0:
        return True  # the history's zero padding (transformers' state starts from zeros)
    lo = max(first, step - config.context_history_size)
    if lo >= step:
        return False
    padded = torch.tensor([0] * width + list(output_ids), dtype=torch.int64)
    contexts = padded.unfold(0, width, 1)[lo - 1 : step - 1]  # [recorded, width]
    return bool((context_hashes(contexts) == context_hash).any())


def synthid_scores(
    config: SynthIDWatermark, scores: torch.Tensor, outputs: Sequence[Sequence[int]]
) -> torch.Tensor:
    """transformers' SynthID step for rows sharing ``config``: ``scores`` [R, V] -> [R, V], each row given
    its generated tokens ``outputs[r]``."""
    if config.debug_mode:
        scores = torch.ones_like(scores)
    out = scores.clone()
    active = [
        r
        for r, ids in enumerate(outputs)
        if not (config.skip_first_ngram_calls and len(ids) + 1 < config.ngram_len)
    ]
    rows_per_chunk = max(1, SYNTHID_CHUNK_ELEMENTS // (scores.shape[1] * config.depth))
    for start in range(0, len(active), rows_per_chunk):
        chunk = active[start : start + rows_per_chunk]
        contexts = torch.tensor([synthid_context(config, outputs[r]) for r in chunk], dtype=torch.int64)
        hashes = context_hashes(contexts)  # [C]
        repeated = torch.tensor(
            [
                _is_repeated_context(config, outputs[r], int(h))
                for r, h in zip(chunk, hashes.tolist(), strict=True)
            ],
            device=scores.device,
        )  # [C]
        sub = scores[chunk]  # [C, V]
        vocab = torch.arange(sub.shape[1], dtype=torch.int64).expand(len(chunk), -1)  # [C, V]
        g = g_values(config, hashes, vocab)  # [C, V, depth]
        out[chunk] = torch.where(repeated[:, None], sub, _tournament(sub, g.to(sub.device)))
    return out


def _tournament(scores: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """transformers' ``update_scores``: each layer moves probability toward tokens whose g-value is 1;
    returns log-probabilities (zero probabilities become the dtype's minimum)."""
    probs = torch.softmax(scores, dim=1)  # [R, V]
    for i in range(g.shape[2]):
        g_at_depth = g[:, :, i]
        g_mass = (g_at_depth * probs).sum(dim=1, keepdim=True)
        probs = probs * (1 + g_at_depth - g_mass)
    log_probs = torch.log(probs)
    return torch.where(torch.isfinite(log_probs), log_probs, torch.finfo(log_probs.dtype).min)


def apply_synthid_watermark(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """SynthID's step over every row with a ``SynthIDWatermark``, batched by config."""
    groups: dict[SynthIDWatermark, list[int]] = {}
    for i, row in enumerate(rows):
        config = row.config.watermarking_config
        if isinstance(config, SynthIDWatermark):
            groups.setdefault(config, []).append(i)
    for config, members in groups.items():
        idx = torch.tensor(members, dtype=torch.int64, device=logits.device)
        scores = logits.index_select(0, idx)
        updated = synthid_scores(config, scores, [rows[i].output_ids for i in members])
        logits.index_copy_(0, idx, updated)


def apply_watermarks(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Every watermarked row of ``logits`` [R, V], in place."""
    apply_greenlist_watermark(logits, rows)
    apply_synthid_watermark(logits, rows)
