"""The C pass behind the sampler's greedy pick (engine/generation/row_argmax.py): each row's maximum and
first argmax, the bits of torch's amax and argmax, whatever the width, ties, signed zeros, infinities and
NaN; and the sampler's results with it the same as without it."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.native_build import KernelUnavailable
from engine.generation.config import GenerationConfig
from engine.generation.rng import RequestRNG
from engine.generation.row_argmax import RowArgmax, load
from engine.generation.rows import SamplingRow
from engine.generation.sampler import Sampler, row_maxima


@pytest.fixture(scope="module")
def kernel() -> RowArgmax:
    try:
        return load()
    except KernelUnavailable as e:
        pytest.skip(f"no C compiler here: {e}")


def _tricky(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    top = x.max().item() + 1.0
    last = vocab - 1
    x[0, last] = top  # the maximum in the tail past the last whole block of lanes
    x[1, [vocab // 3, last]] = top  # a tie across lanes and blocks
    x[2, [min(5, last), min(6, last)]] = top  # a tie in one block
    x[3] = float("-inf")  # every token masked
    x[4] = 0.0  # every token tied
    x[4, min(3, last)] = -0.0  # -0.0 == +0.0: the first column still wins
    x[5] = -0.0
    x[5, last] = 0.0
    x[6, min(9, last)] = float("inf")
    x[6, last] = float("inf")  # two +inf: the first
    x[7, : vocab // 2] = float("-inf")
    x[8] = -3.0e38  # all equal, very negative
    x[9] = torch.randn(vocab, generator=gen).half().float()  # many ties
    return x


@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 31, 1024, 1500, 49152])
def test_each_rows_maximum_and_first_argmax_are_torchs(kernel: RowArgmax, vocab: int) -> None:
    logits = _tricky(12, vocab, vocab)
    maxima, first = kernel(logits)
    assert torch.equal(maxima, logits.amax(dim=1))
    assert torch.equal(first, logits.argmax(dim=1))


@pytest.mark.parametrize("vocab", [5, 49152])
def test_a_nan_anywhere_in_a_row_makes_its_maximum_nan(kernel: RowArgmax, vocab: int) -> None:
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    logits[1, vocab - 1] = float("nan")  # in the tail
    logits[2, 0] = float("nan")
    logits[2, 1] = float("inf")
    maxima, first = kernel(logits)
    assert maxima.isnan().tolist() == [False, True, True, False]
    assert first[1].item() == first[2].item() == -1
    assert torch.equal(maxima[[0, 3]], logits[[0, 3]].amax(dim=1))
    assert torch.equal(first[[0, 3]], logits[[0, 3]].argmax(dim=1))


def test_rows_of_a_wider_tensor_and_many_rows_on_the_threads(kernel: RowArgmax) -> None:
    """The sampler passes a view of the first `vocab_size` columns (rows strided by the padded width); 40
    rows of 49,152 are split over OpenMP's threads."""
    padded = _tricky(40, 49160, 3)
    view = padded[:, :49152]
    maxima, first = kernel(view)
    assert torch.equal(maxima, view.amax(dim=1))
    assert torch.equal(first, view.argmax(dim=1))


def test_other_tensors_are_refused(kernel: RowArgmax) -> None:
    assert not kernel.takes(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not kernel.takes(torch.zeros(8))
    assert not kernel.takes(torch.zeros(8, 2).t())
    with pytest.raises(ValueError):
        kernel(torch.zeros(2, 8, dtype=torch.float64))


def test_row_maxima_is_the_same_with_and_without_the_kernel(kernel: RowArgmax) -> None:
    logits = _tricky(10, 3000, 5)
    with_kernel, without = row_maxima(logits, kernel), row_maxima(logits, None)
    assert torch.equal(with_kernel[0], without[0])
    assert torch.equal(with_kernel[1], without[1])


def test_the_sampler_picks_the_same_tokens_with_the_kernel_as_without(kernel: RowArgmax) -> None:
    """Greedy and sampled rows, a NaN row and a row of -inf, with and without the C pass: the same tokens,
    logprobs and errors."""
    vocab = 1500
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(7))
    logits[2, 10] = float("nan")
    logits[3] = float("-inf")
    greedy = GenerationConfig(do_sample=False, output_logprobs=True, top_logprobs=2)
    sampled = GenerationConfig(do_sample=True, temperature=0.8, seed=11)
    configs = [greedy, sampled, greedy, greedy, sampled, greedy]
    rows = [SamplingRow(c, [1, 2, 3], [], RequestRNG(c.seed, i)) for i, c in enumerate(configs)]
    fast = Sampler(vocab)
    assert fast.has_row_argmax
    with_kernel = fast.sample(logits.clone(), rows)
    without = Sampler(vocab, row_argmax=False).sample(logits.clone(), rows)
    assert with_kernel == without
    assert with_kernel[2].error is not None and with_kernel[3].error is not None
    assert with_kernel[0].token_id == int(logits[0].argmax())
