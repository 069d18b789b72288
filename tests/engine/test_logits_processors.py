"""The batched processors against transformers' own processor classes, row by row and in mixed batches."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from transformers.generation import logits_process as hf

from engine.generation.config import GenerationConfig
from engine.generation.processors import apply_logits_processors, processes
from engine.generation.rows import SamplingRow

V = 512
EOS = 2
PROMPT = [11, 12, 13, 11, 12, 40, 41, 42]
OUTPUT = [50, 11, 12, 7, 1, 2, 11, 1, 2]


def _logits(rows: int = 1, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((rows, V), generator=g) * scale  # [rows, V]


def _row(prompt: list[int] = PROMPT, output: list[int] = OUTPUT, **cfg: Any) -> SamplingRow:
    return SamplingRow(
        config=GenerationConfig(**cfg), prompt_ids=prompt, output_ids=output, eos_token_ids=(EOS,)
    )


def _ours(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return apply_logits_processors(logits.clone(), rows, default_eos=(EOS,))


def _hf(
    proc: Any, logits: torch.Tensor, prompt: list[int] = PROMPT, output: list[int] = OUTPUT
) -> torch.Tensor:
    input_ids = torch.tensor([prompt + output], dtype=torch.int64)  # [1, L]
    return proc(input_ids, logits.clone())


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(a), torch.isinf(b)), "different tokens masked"
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


SAMPLE: dict[str, Any] = {"do_sample": True, "top_k": 0}  # a sampled row with no warper on

# (our config, the transformers processor)
CASES: list[tuple[dict[str, Any], Any]] = [
    ({**SAMPLE, "temperature": 0.7}, hf.TemperatureLogitsWarper(0.7)),
    ({**SAMPLE, "temperature": 1.9}, hf.TemperatureLogitsWarper(1.9)),
    ({**SAMPLE, "top_k": 10}, hf.TopKLogitsWarper(10)),
    ({"do_sample": True}, hf.TopKLogitsWarper(50)),  # the default top_k
    ({**SAMPLE, "top_p": 0.8}, hf.TopPLogitsWarper(0.8)),
    ({**SAMPLE, "top_p": 0.05}, hf.TopPLogitsWarper(0.05)),
    ({**SAMPLE, "min_p": 0.1}, hf.MinPLogitsWarper(0.1)),
    ({**SAMPLE, "typical_p": 0.9}, hf.TypicalLogitsWarper(0.9)),
    ({**SAMPLE, "typical_p": 0.3}, hf.TypicalLogitsWarper(0.3)),
    ({**SAMPLE, "epsilon_cutoff": 5e-4}, hf.EpsilonLogitsWarper(5e-4)),
    ({**SAMPLE, "eta_cutoff": 0.01}, hf.EtaLogitsWarper(0.01)),
    ({"repetition_penalty": 1.3}, hf.RepetitionPenaltyLogitsProcessor(1.3)),
    ({"repetition_penalty": 0.7}, hf.RepetitionPenaltyLogitsProcessor(0.7)),
    ({"no_repeat_ngram_size": 1}, hf.NoRepeatNGramLogitsProcessor(1)),
    ({"no_repeat_ngram_size": 2}, hf.NoRepeatNGramLogitsProcessor(2)),
    ({"no_repeat_ngram_size": 3}, hf.NoRepeatNGramLogitsProcessor(3)),
    (
        {"bad_words_ids": [[5], [EOS], [7, 8], [1, 2, 3], [9, 9, 9]]},
        hf.NoBadWordsLogitsProcessor([[5], [EOS], [7, 8], [1, 2, 3], [9, 9, 9]], eos_token_id=EOS),
    ),
    (
        {"sequence_bias": {(5,): 2.0, (2, 9): -3.0, (1, 2, 11): 4.0, (3, 4): 8.0}},
        hf.SequenceBiasLogitsProcessor([[[5], 2.0], [[2, 9], -3.0], [[1, 2, 11], 4.0], [[3, 4], 8.0]]),
    ),
    ({"suppress_tokens": [1, 2, 3, 300]}, hf.SuppressTokensLogitsProcessor([1, 2, 3, 300])),
    (
        {"min_new_tokens": 10, "max_new_tokens": 20},
        hf.MinNewTokensLengthLogitsProcessor(len(PROMPT), 10, EOS),
    ),
    (
        {"min_new_tokens": 3, "max_new_tokens": 20},  # already reached: no-op
        hf.MinNewTokensLengthLogitsProcessor(len(PROMPT), 3, EOS),
    ),
]


@pytest.mark.parametrize("cfg,proc", CASES, ids=[f"{type(p).__name__}-{i}" for i, (_, p) in enumerate(CASES)])
def test_processor_matches_transformers(cfg: dict[str, Any], proc: Any) -> None:
    logits = _logits(seed=len(str(cfg)))
    ours = _ours(logits, [_row(**cfg)])
    _same(ours, _hf(proc, logits))
    assert not torch.equal(ours, logits) or cfg.get("min_new_tokens") == 3, "the case must change something"


def test_begin_suppress_only_first_token() -> None:
    logits = _logits()
    proc = hf.SuppressTokensAtBeginLogitsProcessor([4, 5], begin_index=len(PROMPT))
    first = _ours(logits, [_row(output=[], begin_suppress_tokens=[4, 5])])
    _same(first, _hf(proc, logits, output=[]))
    assert torch.isinf(first[0, [4, 5]]).all()
    later = _ours(logits, [_row(output=[9], begin_suppress_tokens=[4, 5])])
    _same(later, _hf(proc, logits, output=[9]))
    assert torch.equal(later, logits)


def test_min_new_tokens_masks_stop_token_ids_and_respects_ignore_eos() -> None:
    logits = _logits()
    out = _ours(logits, [_row(min_new_tokens=10, stop_token_ids=[77])])
    assert torch.isinf(out[0, [EOS, 77]]).all()
    out = _ours(logits, [_row(min_new_tokens=10, stop_token_ids=[77], ignore_eos=True)])
    assert torch.isinf(out[0, 77]) and torch.isfinite(out[0, EOS])
    # a config's own eos_token_id replaces the model's when the row names none
    row = SamplingRow(GenerationConfig(min_new_tokens=10, eos_token_id=[8, 9]), PROMPT, OUTPUT)
    out = apply_logits_processors(logits.clone(), [row], default_eos=(EOS,))
    assert torch.isinf(out[0, [8, 9]]).all() and torch.isfinite(out[0, EOS])


def test_full_chain_matches_transformers_in_its_order() -> None:
    """Every option at once equals transformers' processors chained in `_get_logits_processor`'s order."""
    cfg: dict[str, Any] = dict(
        do_sample=True,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.02,
        typical_p=0.95,
        epsilon_cutoff=1e-4,
        eta_cutoff=0.001,
        repetition_penalty=1.2,
        no_repeat_ngram_size=2,
        bad_words_ids=[[5], [1, 2, 3]],
        sequence_bias={(6,): 1.5, (2, 9): -1.0},
        suppress_tokens=[10],
        min_new_tokens=8,
        max_new_tokens=16,
    )
    chain = hf.LogitsProcessorList(
        [
            hf.SequenceBiasLogitsProcessor([[[6], 1.5], [[2, 9], -1.0]]),
            hf.RepetitionPenaltyLogitsProcessor(1.2),
            hf.NoRepeatNGramLogitsProcessor(2),
            hf.NoBadWordsLogitsProcessor([[5], [1, 2, 3]], eos_token_id=EOS),
            hf.MinNewTokensLengthLogitsProcessor(len(PROMPT), 8, EOS),
            hf.SuppressTokensLogitsProcessor([10]),
            hf.TemperatureLogitsWarper(0.8),
            hf.TopKLogitsWarper(40),
            hf.TopPLogitsWarper(0.9),
            hf.MinPLogitsWarper(0.02),
            hf.TypicalLogitsWarper(0.95),
            hf.EpsilonLogitsWarper(1e-4),
            hf.EtaLogitsWarper(0.001),
        ]
    )
    logits = _logits(seed=7, scale=1.0)
    _same(_ours(logits, [_row(**cfg)]), _hf(chain, logits))


def test_greedy_rows_get_no_warpers() -> None:
    logits = _logits()
    cases: list[dict[str, Any]] = [
        {"top_k": 5, "top_p": 0.5},
        {"do_sample": True, "temperature": 0.0, "top_k": 5},
    ]
    for cfg in cases:
        assert torch.equal(_ours(logits, [_row(**cfg)]), logits)


def test_presence_frequency_penalty_openai_formula() -> None:
    logits = _logits()
    output = [3, 3, 3, 9, 9, 100]
    out = _ours(logits, [_row(output=output, presence_penalty=0.5, frequency_penalty=-1.25)])
    counts = Counter(output)
    expected = logits.clone()
    for j in range(V):
        c = counts.get(j, 0)
        expected[0, j] = logits[0, j] - c * -1.25 - float(c > 0) * 0.5
    _same(out, expected)
    # the prompt does not count (OpenAI penalizes the sampled text only)
    assert out[0, PROMPT[0]] == logits[0, PROMPT[0]]


def test_logit_bias_adds_to_logits() -> None:
    logits = _logits()
    out = _ours(logits, [_row(logit_bias={"3": 100, 7: -100.0, 8: 0.5})])
    expected = logits.clone()
    expected[0, 3] += 100.0
    expected[0, 7] -= 100.0
    expected[0, 8] += 0.5
    _same(out, expected)
    assert int(out.argmax()) == 3


MIXED: list[dict[str, Any]] = [
    {},  # greedy, nothing on
    {**SAMPLE, "temperature": 0.5},
    {"do_sample": True},  # default top_k 50
    {**SAMPLE, "top_k": 3, "top_p": 0.7},
    {**SAMPLE, "min_p": 0.3, "temperature": 1.5},
    {**SAMPLE, "typical_p": 0.5},
    {**SAMPLE, "epsilon_cutoff": 1e-3, "eta_cutoff": 0.02},
    {"repetition_penalty": 1.5, "presence_penalty": 1.0},
    {"frequency_penalty": 2.0, "logit_bias": {4: 3.0}},
    {"no_repeat_ngram_size": 2, "bad_words_ids": [[5], [7, 1]]},
    {"sequence_bias": {(9,): 5.0, (1, 2, 20): -2.0}, "suppress_tokens": [0]},
    {"min_new_tokens": 20, "max_new_tokens": 30, "stop_token_ids": [3]},
    {"begin_suppress_tokens": [6]},
    {**SAMPLE, "top_p": 0.9, "repetition_penalty": 0.8},
]


def _mixed_rows() -> list[SamplingRow]:
    rows = []
    for i, cfg in enumerate(MIXED):
        output = [] if "begin_suppress_tokens" in cfg else OUTPUT[: i % len(OUTPUT) + 1]
        rows.append(_row(prompt=PROMPT[: 3 + i % 5], output=output, **cfg))
    return rows


def test_mixed_batch_rows_equal_their_solo_results() -> None:
    rows = _mixed_rows()
    logits = _logits(len(rows), seed=3)
    batch = _ours(logits, rows)
    for i, row in enumerate(rows):
        solo = _ours(logits[i : i + 1], [row])
        assert torch.equal(batch[i : i + 1], solo), f"row {i} ({MIXED[i]}) depends on its batch"
    assert torch.equal(batch[0], logits[0]), "a row with every option off must be untouched"


def test_mixed_batch_is_permutation_invariant() -> None:
    rows = _mixed_rows()
    logits = _logits(len(rows), seed=4)
    batch = _ours(logits, rows)
    perm = list(reversed(range(len(rows))))
    permuted = _ours(logits[perm], [rows[i] for i in perm])
    assert torch.equal(permuted, batch[perm])


def test_every_option_changes_its_row_and_only_it() -> None:
    rows = _mixed_rows()
    logits = _logits(len(rows), seed=5)
    batch = _ours(logits, rows)
    changed = [not torch.equal(batch[i], logits[i]) for i in range(len(rows))]
    assert changed == [False] + [True] * (len(rows) - 1)
    assert all(math.isfinite(float(batch[i].max())) for i in range(len(rows)))
    # the sampler skips the pipeline (and its copy of the logits) for the rows that ``processes`` says it
    # leaves alone: exactly the rows it leaves alone here
    assert [processes(row) for row in rows] == changed


@pytest.mark.parametrize("top_k", [1, 7, 20, 100, 600, 0])
def test_top_p_after_top_k_matches_transformers(top_k: int) -> None:
    """top_p over the few tokens top_k leaves (the sort-only-the-candidates path) and over the whole
    vocabulary (top_k 0 or large) give transformers' result."""
    vocab = 4096
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn((3, vocab), generator=g) * 2.0  # [3, vocab]
    chain: list[Any] = [hf.TopKLogitsWarper(top_k)] if top_k else []
    chain.append(hf.TopPLogitsWarper(0.9))
    rows = [SamplingRow(GenerationConfig(do_sample=True, top_k=top_k, top_p=0.9), [1], [2]) for _ in range(3)]
    ours = apply_logits_processors(logits.clone(), rows)
    for r in range(3):
        _same(ours[r : r + 1], _hf(hf.LogitsProcessorList(chain), logits[r : r + 1], [1], [2]))
