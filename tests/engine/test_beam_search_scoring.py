"""The beam search's scoring alone (engine/generation/beam_search.py), on scripted logits: the same logits
given to transformers' ``generate(num_beams=...)`` (a model whose forward is a table lookup) and to
``BeamSearch`` give the same hypotheses, scores and stopping; and the algorithm's definition on hand-made
cases (beam search beats greedy, EOS, early stopping, length penalty)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_outputs import CausalLMOutputWithPast

from engine.generation.beam_search import BeamSearch

VOCAB = 12
EOS = 3


def scripted_logits(tokens: list[int], seed: int) -> torch.Tensor:
    """Logits ``[VOCAB]`` that depend on the last two tokens only (a seeded table): few tokens and many
    continuations ending on ``EOS``, so that hypotheses finish at every length."""
    g = torch.Generator().manual_seed(
        seed * 1_000_003 + tokens[-1] * 101 + (tokens[-2] if len(tokens) > 1 else 0)
    )
    return torch.randn(VOCAB, generator=g) * 2.0


@pytest.fixture(scope="module")
def scripted_model() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0, eos_token_id=EOS,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@torch.no_grad()
def transformers_search(
    model: Any, prompt: list[int], seed: int, max_new: int, eos: int | None, search: dict[str, Any]
) -> tuple[list[list[int]], list[float]]:
    def forward(input_ids: torch.Tensor, **_: Any) -> CausalLMOutputWithPast:
        rows = [scripted_logits(row.tolist(), seed) for row in input_ids]
        return CausalLMOutputWithPast(logits=torch.stack(rows)[:, None, :])

    model.forward = forward
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        use_cache=False,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        **search,
    )
    beams = []
    for row, indices in zip(out.sequences, out.beam_indices, strict=True):
        beams.append(row[len(prompt) : len(prompt) + int((indices >= 0).sum())].tolist())
    return beams, out.sequences_scores.tolist()


def cbserve_search(
    prompt: list[int], seed: int, max_new: int, eos: int | None, search: dict[str, Any]
) -> tuple[list[list[int]], list[float], int]:
    beams = BeamSearch(
        search["num_beams"],
        max_new,
        [eos] if eos is not None else [],
        search.get("length_penalty", 1.0),
        search.get("early_stopping", False),
    )
    steps = 0
    while not beams.done:
        logits = torch.stack([scripted_logits(prompt + b.token_ids, seed) for b in beams.running])
        beams.step(torch.log_softmax(logits, dim=-1))
        steps += 1
    best = beams.best(search.get("num_return_sequences", 1))
    return [h.token_ids for h in best], [h.score for h in best], steps


SEARCHES: list[dict[str, Any]] = [
    dict(num_beams=2),
    dict(num_beams=3, num_return_sequences=3),
    dict(num_beams=4, num_return_sequences=2, early_stopping=True),
    dict(num_beams=4, early_stopping="never", length_penalty=1.5),
    dict(num_beams=3, early_stopping="never", length_penalty=-0.5),
    dict(num_beams=5, num_return_sequences=4, length_penalty=0.0),
    dict(num_beams=3, early_stopping=True, length_penalty=2.0),
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("eos", [EOS, None])
@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_scoring_equals_transformers_on_scripted_logits(
    scripted_model: Any, search: dict[str, Any], eos: int | None, seed: int
) -> None:
    prompt = [1, 5 + seed % 4]
    expected_beams, expected_scores = transformers_search(scripted_model, prompt, seed, 9, eos, search)
    beams, scores, _ = cbserve_search(prompt, seed, 9, eos, search)
    assert beams == expected_beams
    assert scores == pytest.approx(expected_scores, abs=1e-5)


def scripted_steps(table: dict[tuple[int, ...], dict[int, float]], vocab: int = 4) -> Any:
    """log-probabilities per history (missing tokens: -inf)."""

    def rows(histories: list[list[int]]) -> torch.Tensor:
        out = torch.full((len(histories), vocab), -math.inf)
        for i, h in enumerate(histories):
            for token, p in table.get(tuple(h), {}).items():
                out[i, token] = math.log(p)
        return out

    return rows


def run_scripted(search: BeamSearch, table: dict[tuple[int, ...], dict[int, float]]) -> int:
    rows = scripted_steps(table)
    steps = 0
    while not search.done:
        search.step(rows([b.token_ids for b in search.running]))
        steps += 1
    return steps


def test_beam_search_finds_the_sequence_greedy_misses() -> None:
    # greedy takes 0 (0.5) then 0.4; the beams keep 1 (0.4), whose 0.9 makes the better sequence
    table = {(): {0: 0.5, 1: 0.4, 2: 0.1}, (0,): {0: 0.4, 1: 0.3, 2: 0.3}, (1,): {2: 0.9, 0: 0.1}}
    search = BeamSearch(2, max_new_tokens=2, stop_token_ids=[], length_penalty=0.0)
    assert run_scripted(search, table) == 2
    best = search.best(2)
    assert [h.token_ids for h in best] == [[1, 2], [0, 0]]
    assert [h.score for h in best] == pytest.approx([math.log(0.36), math.log(0.2)], abs=1e-6)
    assert [lp.logprob for lp in best[0].logprobs] == pytest.approx([math.log(0.4), math.log(0.9)], abs=1e-6)


def test_a_beam_that_ends_on_eos_is_a_hypothesis_scored_by_its_length() -> None:
    # 3 (EOS) at once is a finished hypothesis of length 1; early_stopping=True ends at num_beams of them
    table = {(): {3: 0.6, 0: 0.3, 1: 0.1}, (0,): {3: 0.5, 1: 0.5}, (1,): {3: 0.9, 2: 0.1}}
    search = BeamSearch(2, max_new_tokens=5, stop_token_ids=[3], length_penalty=1.0, early_stopping=True)
    assert run_scripted(search, table) == 2
    best = search.best(2)
    assert [h.token_ids for h in best] == [[3], [0, 3]]
    assert [h.score for h in best] == pytest.approx([math.log(0.6), math.log(0.15) / 2], abs=1e-6)


def test_early_stopping_never_searches_to_the_length_limit_with_a_positive_penalty() -> None:
    table = {(): {3: 0.5, 0: 0.45}, (0,): {0: 0.99, 3: 0.01}, (0, 0): {0: 0.99, 3: 0.01}}
    table.update({(0, 0, 0): {3: 1.0}})
    heuristic = BeamSearch(1, max_new_tokens=4, stop_token_ids=[3], length_penalty=1.0, early_stopping=False)
    never = BeamSearch(1, max_new_tokens=4, stop_token_ids=[3], length_penalty=1.0, early_stopping="never")
    assert run_scripted(heuristic, table) == 1  # log(0.45) / 1 cannot beat log(0.5) / 1
    assert heuristic.best(1)[0].token_ids == [3]
    assert run_scripted(never, table) == 4  # log(0.45) / 4 might: searched to the end
    assert never.best(1)[0].token_ids == [0, 0, 0, 3]


def test_a_search_over_is_over() -> None:
    search = BeamSearch(2, max_new_tokens=1, stop_token_ids=[])
    assert search.step(torch.log_softmax(torch.randn(2, 4), dim=-1)) == []
    assert search.done
    with pytest.raises(RuntimeError):
        search.step(torch.zeros(2, 4))
