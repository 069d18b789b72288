"""Batched logits processors: one tensor op over every row that uses an option, with per-row parameter
tensors, so requests with different options share one step.

Semantics match ``transformers.generation.logits_process`` row by row. A row whose option is off is not
touched (each op runs only over the rows that use it), so a row's result never depends on its batch.
Only the processors that are per-sequence by nature (no_repeat_ngram, multi-token bad_words and
sequence_bias) loop in Python, and only over the rows that use them.

Order (``transformers``' ``_get_logits_processor``, with the OpenAI/vLLM extras placed beside their
kin): sequence_bias, logit_bias, repetition_penalty, presence/frequency penalties, no_repeat_ngram,
bad_words, min_new_tokens (EOS + stop_token_ids), suppress_tokens, begin_suppress_tokens; then the
user's processors (user_processors.py), where transformers merges ``generate``'s ``logits_processor``;
then, for sampled rows only, the warpers: temperature, top_k, top_p, min_p, typical_p, epsilon, eta; last, as
transformers places it, the watermark (watermark.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.generation.rows import SamplingRow
from engine.generation.watermark import apply_watermarks

NEG_INF = float("-inf")


def _index(idx: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(idx, dtype=torch.int64, device=device)


def _apply_to_rows(
    logits: torch.Tensor, idx: list[int], fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> None:
    """``logits[idx] = fn(logits[idx], idx_tensor)`` in place; rows outside ``idx`` are untouched."""
    if not idx:
        return
    idx_t = _index(idx, logits.device)
    if len(idx) == logits.shape[0] and idx == list(range(len(idx))):
        logits.copy_(fn(logits, idx_t))  # every row: skip the gather (fn must not write its input)
        return
    sub = logits.index_select(0, idx_t)  # [len(idx), V]
    logits.index_copy_(0, idx_t, fn(sub, idx_t))


def _row_param(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)  # [rows, 1]


def _padded_ids(seqs: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Ragged id lists as one [rows, max_len] tensor padded with ``pad`` (a spare column past the vocab)."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), max(width, 1)), pad, dtype=torch.int64)
    for i, s in enumerate(seqs):
        if s:
            out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.int64)
    return out.to(device)


def _all_ids(row: SamplingRow) -> list[int]:
    return list(row.prompt_ids) + list(row.output_ids)


def _mask_tokens(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Set ``logits[row, token] = -inf`` for each (row, token); ids outside the vocabulary are skipped
    (they cannot be generated anyway)."""
    vocab = logits.shape[1]
    pairs = [(r, t) for r, t in pairs if 0 <= t < vocab]
    if not pairs:
        return
    rows_t = torch.tensor([r for r, _ in pairs], dtype=torch.int64, device=logits.device)
    toks_t = torch.tensor([t for _, t in pairs], dtype=torch.int64, device=logits.device)
    logits.index_put_((rows_t, toks_t), torch.tensor(NEG_INF, dtype=logits.dtype, device=logits.device))


# ---------------------------------------------------------------------------------------- biases
def apply_sequence_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """HF ``SequenceBiasLogitsProcessor``: single-token biases always; a multi-token sequence's bias on
    its last token when the context ends with the rest of it."""
    idx = [i for i, r in enumerate(rows) if r.config.sequence_bias]
    if not idx:
        return
    vocab = logits.shape[1]
    bias = torch.zeros((len(idx), vocab), dtype=torch.float32)  # [rows, V], built on CPU then moved
    for j, i in enumerate(idx):
        row = rows[i]
        assert row.config.sequence_bias is not None
        context: list[int] | None = None
        for ids, b in row.config.sequence_bias.items():
            if ids[-1] >= vocab:
                continue
            if len(ids) == 1:
                bias[j, ids[0]] = b
                continue
            if context is None:
                context = _all_ids(row)
            prefix = list(ids[:-1])
            if len(prefix) <= len(context) and context[len(context) - len(prefix) :] == prefix:
                bias[j, ids[-1]] += b
    bias = bias.to(device=logits.device, dtype=logits.dtype)
    _apply_to_rows(logits, idx, lambda sub, _: sub + bias)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """OpenAI ``logit_bias``: ``logit[token] += bias`` before sampling."""
    vocab = logits.shape[1]
    r_idx: list[int] = []
    t_idx: list[int] = []
    vals: list[float] = []
    for i, row in enumerate(rows):
        for token, b in (row.config.logit_bias or {}).items():
            if 0 <= token < vocab:
                r_idx.append(i)
                t_idx.append(token)
                vals.append(b)
    if not r_idx:
        return
    dev = logits.device
    logits.index_put_(
        (_index(r_idx, dev), _index(t_idx, dev)),
        torch.tensor(vals, dtype=logits.dtype, device=dev),
        accumulate=True,
    )


# ---------------------------------------------------------------------------------------- penalties
def apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """HF ``RepetitionPenaltyLogitsProcessor`` (CTRL): every token seen in prompt or output has its logit
    divided by the penalty when positive, multiplied when negative."""
    idx = [i for i, r in enumerate(rows) if r.config.repetition_penalty != 1.0]
    if not idx:
        return
    vocab = logits.shape[1]
    ids = _padded_ids([_all_ids(rows[i]) for i in idx], vocab, logits.device)  # [rows, L]
    penalty = _row_param([rows[i].config.repetition_penalty for i in idx], logits)  # [rows, 1]

    def fn(sub: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        seen = torch.zeros((sub.shape[0], vocab + 1), dtype=torch.bool, device=sub.device)
        seen.scatter_(1, ids.clamp(max=vocab), True)  # the pad column absorbs padding
        penalized = torch.where(sub < 0, sub * penalty, sub / penalty)
        return torch.where(seen[:, :vocab], penalized, sub)

    _apply_to_rows(logits, idx, fn)


def apply_presence_frequency_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """OpenAI's formula over the tokens generated so far (not the prompt):
    ``logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``."""
    idx = [
        i for i, r in enumerate(rows) if r.config.presence_penalty != 0.0 or r.config.frequency_penalty != 0.0
    ]
    if not idx:
        return
    vocab = logits.shape[1]
    ids = _padded_ids([rows[i].output_ids for i in idx], vocab, logits.device)  # [rows, L]
    freq = _row_param([rows[i].config.frequency_penalty for i in idx], logits)  # [rows, 1]
    pres = _row_param([rows[i].config.presence_penalty for i in idx], logits)  # [rows, 1]

    def fn(sub: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros((sub.shape[0], vocab + 1), dtype=sub.dtype, device=sub.device)
        counts.scatter_add_(1, ids.clamp(max=vocab), torch.ones_like(ids, dtype=sub.dtype))
        counts = counts[:, :vocab]  # [rows, V]
        return sub - counts * freq - (counts > 0).to(sub.dtype) * pres

    _apply_to_rows(logits, idx, fn)


# ---------------------------------------------------------------------------------------- bans
def apply_no_repeat_ngram(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """HF ``NoRepeatNGramLogitsProcessor``: ban each token that would repeat an n-gram of the context."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        n = row.config.no_repeat_ngram_size
        if n <= 0:
            continue
        context = torch.as_tensor(_all_ids(row), dtype=torch.int64)  # [L]
        if context.numel() < n:
            continue
        prefix = context[context.numel() + 1 - n :]  # [n - 1]
        windows = context.unfold(0, n, 1)  # [L - n + 1, n]
        matches = (windows[:, :-1] == prefix).all(dim=-1)
        banned = windows[matches, -1].unique().tolist()
        _mask_tokens(logits, [(i, t) for t in banned if t < vocab])


def row_eos_token_ids(row: SamplingRow, default_eos: tuple[int, ...]) -> tuple[int, ...]:
    """The row's resolved EOS ids: its own, else its config's, else the model's ``default_eos``."""
    if row.eos_token_ids is not None:
        return row.eos_token_ids
    return row.config.eos_token_ids or default_eos


def apply_bad_words(logits: torch.Tensor, rows: Sequence[SamplingRow], default_eos: tuple[int, ...]) -> None:
    """HF ``NoBadWordsLogitsProcessor``: single-token bad words always banned (except a lone EOS, which
    HF drops from the list); a multi-token one's last token banned when the context ends with the rest."""
    pairs: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        if not row.config.bad_words_ids:
            continue
        eos = set(row_eos_token_ids(row, default_eos))
        context: list[int] | None = None
        for word in row.config.bad_words_ids:
            if len(word) == 1:
                if word[0] not in eos:
                    pairs.append((i, word[0]))
                continue
            if context is None:
                context = _all_ids(row)
            prefix = word[:-1]
            if len(prefix) <= len(context) and context[len(context) - len(prefix) :] == prefix:
                pairs.append((i, word[-1]))
    _mask_tokens(logits, pairs)


def apply_min_new_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], default_eos: tuple[int, ...]
) -> None:
    """HF ``MinNewTokensLengthLogitsProcessor``, extended to vLLM's stop_token_ids: while fewer than
    ``min_new_tokens`` tokens are generated, EOS (unless ``ignore_eos``) and stop tokens cannot be chosen."""
    pairs: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        cfg = row.config
        if row.num_output_tokens >= cfg.min_new_tokens:
            continue
        stops = list(cfg.stop_token_ids or [])
        if not cfg.ignore_eos:
            stops += row_eos_token_ids(row, default_eos)
        pairs.extend((i, t) for t in stops)
    _mask_tokens(logits, pairs)


def apply_suppress_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """HF ``SuppressTokensLogitsProcessor`` and ``SuppressTokensAtBeginLogitsProcessor`` (the latter
    only for the first generated token)."""
    pairs: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        pairs.extend((i, t) for t in row.config.suppress_tokens or [])
        if row.num_output_tokens == 0:
            pairs.extend((i, t) for t in row.config.begin_suppress_tokens or [])
    _mask_tokens(logits, pairs)


# ---------------------------------------------------------------------------------------- warpers
def apply_temperature(logits: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """HF ``TemperatureLogitsWarper``: ``logits / temperature`` (rows at 1.0 are skipped: exact no-op)."""
    use = [i for i in idx if rows[i].config.temperature != 1.0]
    temp = _row_param([rows[i].config.temperature for i in use], logits)
    _apply_to_rows(logits, use, lambda sub, _: sub / temp)


def apply_top_k(logits: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """HF ``TopKLogitsWarper``: drop tokens below the k-th largest logit (ties with it are kept)."""
    vocab = logits.shape[1]
    use = [i for i in idx if 0 < rows[i].config.top_k < vocab]
    if not use:
        return
    ks = [rows[i].config.top_k for i in use]
    k_index = torch.tensor(ks, dtype=torch.int64, device=logits.device).unsqueeze(1) - 1  # [rows, 1]

    def fn(sub: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        top = torch.topk(sub, max(ks), dim=-1).values  # [rows, max_k], descending
        kth = top.gather(1, k_index)  # [rows, 1]
        return sub.masked_fill(sub < kth, NEG_INF)

    _apply_to_rows(logits, use, fn)


def _top_p_remove(sorted_logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Which of the ascending-sorted logits top-p removes (HF's arithmetic)."""
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [rows, n]
    remove = cumulative <= threshold
    remove[..., -1:] = False  # min_tokens_to_keep = 1
    return remove


def apply_top_p(logits: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """HF ``TopPLogitsWarper``: keep the smallest set of most likely tokens whose mass reaches top_p.

    NOTE: sorting the whole vocabulary is the cost here. After top_k (on by default) few tokens are
    left, so a row with at most V/8 finite logits sorts only its top ``b`` (``b`` the power of two
    above its own count: masked tokens have probability 0 and were removed already). The width depends
    on the row alone, so its result does not depend on its batch."""
    use = [i for i in idx if rows[i].config.top_p < 1.0]
    threshold_all = [1.0 - rows[i].config.top_p for i in use]

    def fn(sub: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        vocab = sub.shape[1]
        groups: dict[int, list[int]] = {}
        for j, n in enumerate(torch.isfinite(sub).sum(dim=1).tolist()):
            width = 1 << max(int(n) - 1, 0).bit_length()  # next power of two >= n
            groups.setdefault(width if width * 8 <= vocab else vocab, []).append(j)
        out = sub.clone()
        for width, members in groups.items():
            sel = torch.tensor(members, dtype=torch.int64, device=sub.device)
            part = sub.index_select(0, sel)  # [m, V]
            threshold = _row_param([threshold_all[j] for j in members], sub)  # [m, 1]
            if width == vocab:
                sorted_logits, sorted_indices = torch.sort(part, descending=False)  # [m, V]
                remove = _top_p_remove(sorted_logits, threshold)
                remove = remove.scatter(1, sorted_indices, remove)
            else:
                top_vals, top_idx = torch.topk(part, width, dim=-1)  # [m, width], descending
                cand_remove = _top_p_remove(top_vals.flip(-1), threshold)  # ascending, like HF
                # tokens outside the candidates are already -inf: removing them again changes nothing
                remove = torch.ones_like(part, dtype=torch.bool).scatter(1, top_idx.flip(-1), cand_remove)
            out.index_copy_(0, sel, part.masked_fill(remove, NEG_INF))
        return out

    _apply_to_rows(logits, use, fn)


def apply_min_p(logits: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """HF ``MinPLogitsWarper``: drop tokens less likely than ``min_p`` times the top token."""
    use = [i for i in idx if rows[i].config.min_p]  # None and 0.0 are both no-ops
    min_p = _row_param([rows[i].config.min_p or 0.0 for i in use], logits)  # [rows, 1]

    def fn(sub: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(sub, dim=-1)  # [rows, V]
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        return sub.masked_fill(remove, NEG_INF)

    _apply_to_rows(logits, use, fn)


def apply_typical_p(logits: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """HF ``TypicalLogitsWarper`` (locally typical sampling)."""
    use = [i for i in idx if rows[i].config.typical_p < 1.0]
    mass = _row_param([rows[i].config.typical_p for i in use], logits)  # [rows, 1]

    def fn(sub: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        normalized = torch.nn.functional.log_softmax(sub, dim=-1)  # [rows, V]
        p = torch.exp(normalized)
        ent = -(normalized * p).nansum(-1, keepdim=True)  # [rows, 1]
        shifted = torch.abs((-normalized) - ent)
        sorted_scores, sorted_indices = torch.sort(shifted, descending=False)
        cumulative = sub.gather(-1, sorted_indices).softmax(dim=-1).cumsum(dim=-1)
        last_ind = (cumulative < mass).sum(dim=1)  # [rows]
        last_ind.clamp_(max=sorted_scores.shape[-1] - 1)
        remove = sorted_scores > sorted_scores.gather(1, last_ind.view(-1, 1))
        remove[..., :1] = False  # min_tokens_to_keep = 1
        remove = remove.scatter(1, sorted_indices, remove)
        return sub.masked_fill(remove, NEG_INF)

    _apply_to_rows(logits, use, fn)


def _keep_top1(sub: torch.Tensor, remove: torch.Tensor) -> torch.Tensor:
    # min_tokens_to_keep = 1, as HF: never drop the best token
    return remove & (sub < sub.max(dim=-1, keepdim=True).values)


def apply_epsilon(logits: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """HF ``EpsilonLogitsWarper``: drop tokens with probability below epsilon_cutoff."""
    use = [i for i in idx if 0.0 < rows[i].config.epsilon_cutoff < 1.0]
    eps = _row_param([rows[i].config.epsilon_cutoff for i in use], logits)  # [rows, 1]

    def fn(sub: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        remove = sub.softmax(dim=-1) < eps
        return sub.masked_fill(_keep_top1(sub, remove), NEG_INF)

    _apply_to_rows(logits, use, fn)


def apply_eta(logits: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """HF ``EtaLogitsWarper``: drop tokens below ``min(eta, sqrt(eta) * exp(-entropy))``."""
    use = [i for i in idx if 0.0 < rows[i].config.eta_cutoff < 1.0]
    eps = torch.tensor([rows[i].config.eta_cutoff for i in use], dtype=torch.float32, device=logits.device)

    def fn(sub: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        probs = sub.softmax(dim=-1)  # [rows, V]
        # torch.distributions.Categorical(logits=sub).entropy(), without its argument validation
        norm = sub - sub.logsumexp(dim=-1, keepdim=True)
        norm = norm.clamp(min=torch.finfo(norm.dtype).min)
        entropy = -(norm * probs).sum(-1)  # [rows]
        eta = torch.min(eps, torch.sqrt(eps) * torch.exp(-entropy))[..., None].to(sub.dtype)  # [rows, 1]
        return sub.masked_fill(_keep_top1(sub, probs < eta), NEG_INF)

    _apply_to_rows(logits, use, fn)


# ---------------------------------------------------------------------------------------- pipeline
def processes(row: SamplingRow) -> bool:
    """Whether ``apply_logits_processors`` may change ``row``'s logits (the user's processors aside): False
    only for a greedy row with every option of the pipeline below off, which the sampler then reads as the
    model gave it."""
    c = row.config
    return not (
        c.is_greedy
        and not c.sequence_bias
        and not c.logit_bias
        and c.repetition_penalty == 1.0
        and c.presence_penalty == 0.0
        and c.frequency_penalty == 0.0
        and c.no_repeat_ngram_size <= 0
        and not c.bad_words_ids
        and row.num_output_tokens >= c.min_new_tokens
        and not c.suppress_tokens
        and not c.begin_suppress_tokens
        and c.watermarking_config is None
    )


def apply_logits_processors(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    default_eos: tuple[int, ...] = (),
    user_processors: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Run every processor, in order, over ``logits`` [R, V] (modified in place and returned).

    ``default_eos``: the model's EOS ids, for rows that name none themselves. ``user_processors``: runs
    the user's processors over ``logits`` in place, after cbserve's own and before the warpers.
    """
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logits rows but {len(rows)} sampling rows")
    apply_sequence_bias(logits, rows)
    apply_logit_bias(logits, rows)
    apply_repetition_penalty(logits, rows)
    apply_presence_frequency_penalty(logits, rows)
    apply_no_repeat_ngram(logits, rows)
    apply_bad_words(logits, rows, default_eos)
    apply_min_new_tokens(logits, rows, default_eos)
    apply_suppress_tokens(logits, rows)
    if user_processors is not None:
        user_processors(logits)
    sampled = [i for i, r in enumerate(rows) if not r.config.is_greedy]
    if sampled:
        apply_temperature(logits, rows, sampled)
        apply_top_k(logits, rows, sampled)
        apply_top_p(logits, rows, sampled)
        apply_min_p(logits, rows, sampled)
        apply_typical_p(logits, rows, sampled)
        apply_epsilon(logits, rows, sampled)
        apply_eta(logits, rows, sampled)
    apply_watermarks(logits, rows)
    return logits
