"""Sampler: greedy and sampled rows in one batch, per-request determinism, the sampled distribution,
logprobs and per-row errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.errors import UnsatisfiableOptionsError
from engine.generation.config import GenerationConfig
from engine.generation.rng import RequestRNG
from engine.generation.rows import SamplingRow
from engine.generation.sampler import Sampler, argmax_rows, block_maxima

V = 256


def _logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((rows, vocab), generator=g) * 2.0  # [rows, vocab]


def _row(output: list[int] | None = None, seed: int | None = None, index: int = 0, **cfg: Any) -> SamplingRow:
    config = GenerationConfig(seed=seed, **cfg)
    return SamplingRow(config, [1, 2, 3], list(output or []), RequestRNG(seed, index))


def _generate(
    sampler: Sampler, row_cfg: dict[str, Any], steps: int, batch_mates: int, position: int
) -> list[int]:
    """Run one seeded sequence for ``steps`` tokens, each step in a batch of random other rows, its
    logits a function of its own history only."""
    out: list[int] = []
    for step in range(steps):
        own = _logits(1, seed=1000 + (out[-1] if out else 0))  # [1, V]
        others = _logits(batch_mates, seed=step)
        logits = torch.cat([others[:position], own, others[position:]])  # [batch_mates + 1, V]
        rows = [_row([step], seed=None, do_sample=True, temperature=1.3) for _ in range(batch_mates)]
        rows.insert(position, _row(out, **row_cfg))
        out.append(sampler.sample(logits, rows)[position].token_id)
    return out


def test_seeded_request_is_independent_of_batch_and_position() -> None:
    sampler = Sampler(V)
    cfg = {"seed": 1234, "do_sample": True, "temperature": 1.5, "top_k": 0}
    alone = _generate(sampler, cfg, steps=12, batch_mates=0, position=0)
    assert _generate(sampler, cfg, steps=12, batch_mates=5, position=0) == alone
    assert _generate(sampler, cfg, steps=12, batch_mates=5, position=3) == alone
    assert _generate(sampler, cfg, steps=12, batch_mates=9, position=9) == alone
    other_seed = _generate(sampler, {**cfg, "seed": 99}, steps=12, batch_mates=0, position=0)
    assert other_seed != alone
    assert len(set(alone)) > 3, "a temperature-1.5 sample over 256 tokens should vary"


def test_greedy_and_sampled_rows_in_one_batch() -> None:
    sampler = Sampler(V)
    logits = _logits(4, seed=1)
    rows = [
        _row(),  # greedy
        _row(seed=5, do_sample=True),
        _row(do_sample=True, temperature=0.0),  # temperature 0 is greedy
        _row(seed=6, do_sample=True, top_k=1),  # top-1 sampling is greedy too
    ]
    out = sampler.sample(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    assert out[0].token_id == argmax[0]
    assert out[2].token_id == argmax[2]
    assert out[3].token_id == argmax[3]
    assert 0 <= out[1].token_id < V
    assert all(t.error is None and t.logprob is None for t in out)


def test_sampled_distribution_matches_softmax() -> None:
    """4000 independent draws (4000 seeds) from one 8-token distribution: Pearson chi-square test."""
    vocab = 8
    sampler = Sampler(vocab)
    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])  # [1, 8]
    n = 4000
    logits = base.expand(n, vocab).contiguous()  # [n, 8]
    rows = [_row(seed=s, do_sample=True, top_k=0) for s in range(n)]
    tokens = [t.token_id for t in sampler.sample(logits, rows)]
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    expected = torch.softmax(base[0].double(), dim=-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, (
        f"chi-square {chi2:.1f} over the p=0.001 critical value (7 dof); counts {counts.tolist()}"
    )


def test_sampling_respects_warpers() -> None:
    vocab = 8
    sampler = Sampler(vocab)
    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    n = 1000
    rows = [_row(seed=s, do_sample=True, top_k=3) for s in range(n)]
    tokens = {t.token_id for t in sampler.sample(base.expand(n, vocab).contiguous(), rows)}
    assert tokens == {0, 6, 1}


def test_num_return_sequences_rows_use_their_own_streams() -> None:
    sampler = Sampler(V)
    logits = _logits(1, seed=2).expand(4, V).contiguous()
    rows = [_row(seed=7, index=i, do_sample=True, top_k=0, temperature=2.0) for i in range(4)]
    first = [t.token_id for t in sampler.sample(logits, rows)]
    again = [t.token_id for t in sampler.sample(logits, rows)]
    assert first == again
    assert len(set(first)) > 1, "different sample indexes must draw different streams"


def test_unseeded_requests_differ() -> None:
    assert RequestRNG().seed != RequestRNG().seed
    rng = RequestRNG(5)
    draws = [rng.uniform(i) for i in range(1000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.05
    assert RequestRNG(5).uniform(3) == draws[3]
    assert RequestRNG(5, 1).uniform(3) != draws[3]


def test_logprobs_of_processed_logits() -> None:
    sampler = Sampler(V)
    logits = _logits(3, seed=3)
    rows = [
        _row(output_logprobs=True, top_logprobs=5),
        _row(seed=1, do_sample=True, top_k=4, output_logprobs=True, top_logprobs=20),
        _row(output_logprobs=True),
    ]
    out = sampler.sample(logits, rows)
    lp0 = torch.log_softmax(logits[0], dim=-1)
    assert out[0].logprob is not None
    assert out[0].logprob.token_id == out[0].token_id
    assert out[0].logprob.logprob == pytest.approx(float(lp0.max()), abs=1e-5)
    top = out[0].logprob.top
    assert [t for t, _ in top] == lp0.topk(5).indices.tolist()
    assert [v for _, v in top] == pytest.approx(lp0.topk(5).values.tolist(), abs=1e-5)
    # after top_k=4, only 4 tokens have a probability; their logprobs renormalize over those 4
    lp1 = out[1].logprob
    assert lp1 is not None and len(lp1.top) == 4
    kept = logits[1].topk(4)
    expected = torch.log_softmax(kept.values, dim=-1)
    assert [t for t, _ in lp1.top] == kept.indices.tolist()
    assert [v for _, v in lp1.top] == pytest.approx(expected.tolist(), abs=1e-5)
    assert lp1.token_id in kept.indices.tolist()
    assert out[2].logprob is not None and out[2].logprob.top == []


def test_nan_row_fails_alone() -> None:
    sampler = Sampler(V)
    logits = _logits(3, seed=4)
    logits[1, 7] = float("nan")
    logits[2, 9] = float("inf")
    rows = [_row(), _row(seed=1, do_sample=True), _row()]
    out = sampler.sample(logits, rows)
    assert out[0].error is None and out[0].token_id == int(logits[0].argmax())
    assert out[1].error is not None and "NaN" in out[1].error and out[1].token_id == -1
    assert out[2].error is not None


def test_infinite_and_ruled_out_logits_of_greedy_rows() -> None:
    """+inf beside -inf is a broken row (the model's fault, no code); -inf alone is a token ruled out, and a
    row of nothing else leaves no token (the request's options: its code)."""
    logits = _logits(3, seed=6)
    logits[0, 3], logits[0, 5] = float("inf"), float("-inf")
    logits[1, 2] = float("-inf")
    logits[2] = float("-inf")
    out = Sampler(V).sample(logits, [_row(), _row(), _row()])
    assert out[0].error is not None and "infinite" in out[0].error and out[0].error_code is None
    assert out[1].error is None and out[1].token_id == int(logits[1].argmax())
    assert out[2].error is not None and out[2].error_code == UnsatisfiableOptionsError.code


def test_fully_masked_row_fails_alone() -> None:
    sampler = Sampler(8)
    logits = _logits(2, seed=5, vocab=8)
    rows = [_row(suppress_tokens=list(range(8))), _row()]
    out = sampler.sample(logits, rows)
    assert out[0].error is not None and "masked" in out[0].error
    assert out[1].error is None


def test_padded_vocabulary_columns_are_never_chosen() -> None:
    sampler = Sampler(V)
    logits = _logits(2, seed=6, vocab=V + 64)
    logits[:, V:] = 100.0  # the model's padding columns
    out = sampler.sample(logits, [_row(), _row(seed=3, do_sample=True)])
    assert all(0 <= t.token_id < V for t in out)


def test_input_logits_are_not_modified() -> None:
    sampler = Sampler(V)
    logits = _logits(1, seed=8)
    before = logits.clone()
    sampler.sample(logits, [_row(repetition_penalty=2.0, suppress_tokens=[1])])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("bad_row", [False, True])
def test_plain_greedy_rows_leave_the_input_as_it_was_and_take_its_argmax(bad_row: bool) -> None:
    """Rows that nothing processes are read in place (no copy) unless a bad row must be neutralised: either
    way the caller's logits stay untouched."""
    logits = _logits(3, seed=9)
    if bad_row:
        logits[1, 4] = float("nan")
    before = logits.clone()
    out = Sampler(V).sample(logits, [_row(), _row(), _row()])
    assert torch.equal(logits.nan_to_num(), before.nan_to_num()) and bool(logits[1, 4].isnan()) == bad_row
    assert [t.token_id for t in out] == [
        -1 if bad_row and i == 1 else int(logits[i].argmax()) for i in range(3)
    ]
    assert (out[1].error is not None) == bad_row


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError):
        Sampler(V).sample(_logits(2), [_row()])


@pytest.mark.parametrize("vocab", [49152, 3000, 2048, 1500, 7])
def test_argmax_rows_is_torch_argmax_with_ties_masks_and_a_short_last_block(vocab: int) -> None:
    """The greedy pick reads block maxima first (sampler.argmax_rows); it must still be the FIRST index of
    the row's maximum, wherever the maximum and its ties fall."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=gen)
    top = logits.max().item() + 1.0
    logits[1, [vocab - 1]] = top  # the maximum in the (short) last block
    logits[2, [vocab // 3, vocab - 1]] = top  # a tie across blocks
    logits[3, [min(5, vocab - 1), min(6, vocab - 1)]] = top  # a tie inside one block
    logits[4, : vocab // 2] = float("-inf")  # masked tokens
    logits[5] = 0.0  # every token tied
    logits[6, 0] = top  # the very first token
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=1))
    assert torch.equal(argmax_rows(logits, block_maxima(logits)), logits.argmax(dim=1))
    assert argmax_rows(logits)[5].item() == 0


@pytest.mark.parametrize("vocab", [49152, 3000, 1024, 7])
def test_block_maxima_give_each_rows_maximum_nan_and_infinities_included(vocab: int) -> None:
    """The sampler's dead-row check reads the rows' maxima from their block maxima: exactly amax(dim=1)."""
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1, vocab - 1] = float("nan")  # in the (short) last block
    logits[2] = float("-inf")  # every token masked
    logits[3, vocab // 2] = float("inf")
    expected = logits.amax(dim=1)
    got = block_maxima(logits).amax(dim=1)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
