"""Constrained beam search (engine/generation/constrained_beam_search.py, constraints.py): the constraints'
definitions, the search on scripted logits (the forced words appear; beams are ranked by their bank first;
an impossible constraint still returns the best sequences), and in the continuous batch on a tiny random
model the same beams as the scoring driven by transformers' own forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from beam_harness import PROMPTS, TinyModel, options_of, run

from engine.generation.beam_search import BeamChoice
from engine.generation.config import GenerationConfig, GenerationConfigError
from engine.generation.constrained_beam_search import ConstrainedBeamSearch
from engine.generation.constraints import (
    ConstraintListState,
    DisjunctiveConstraint,
    PhrasalConstraint,
    constraints_of,
)

VOCAB = 10


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_a_phrase_progresses_token_by_token_and_starts_over_when_broken() -> None:
    phrase = PhrasalConstraint([4, 5, 6])
    assert phrase.advance() == [4]
    assert phrase.update(4) == (True, False, False) and phrase.remaining() == 2
    assert phrase.update(9) == (False, False, True) and phrase.advance() == [4]
    for t in (4, 5):
        phrase.update(t)
    assert phrase.update(6) == (True, True, False) and phrase.completed and phrase.advance() == []


def test_a_disjunction_follows_its_trie_and_refuses_a_word_prefix_of_another() -> None:
    words = DisjunctiveConstraint([[1, 2, 3], [1, 4], [5]])
    assert sorted(words.advance()) == [1, 5]
    words.update(1)
    assert sorted(words.advance()) == [2, 4] and words.remaining() == 2
    assert words.update(4) == (True, True, False) and words.completed
    with pytest.raises(ValueError):
        DisjunctiveConstraint([[1, 2], [1, 2, 3]])


def test_the_list_state_counts_banks_and_completes_with_every_constraint() -> None:
    constraints = constraints_of([[4, 5], [[7], [8, 9]]])
    assert isinstance(constraints[0], PhrasalConstraint) and isinstance(constraints[1], DisjunctiveConstraint)
    state = ConstraintListState.of(constraints, [1, 4])
    assert state.bank == 1 and state.advance() == [5]  # max_seqlen 2: the phrase half done
    state = ConstraintListState.of(constraints, [1, 4, 5, 3])
    assert state.bank == 2 and sorted(state.advance()) == [7, 8] and not state.completed
    assert ConstraintListState.of(constraints, [8, 9, 2, 4, 5]).completed
    assert ConstraintListState.of(constraints, [4, 3, 5, 7]).bank == 2  # the broken phrase starts over


def scripted(history: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 104729 + sum((i + 3) * t for i, t in enumerate(history[-2:])))
    row = torch.randn(VOCAB, generator=g) * 2.0
    row[[7, 8]] -= 6.0  # the forced tokens are unlikely: without the constraints they never come
    return torch.log_softmax(row, dim=-1)


def drive(search: ConstrainedBeamSearch, seed: int) -> list[list[BeamChoice]]:
    steps = []
    while not search.done:
        steps.append(search.step(torch.stack([scripted([1, *b.token_ids], seed) for b in search.running])))
    return steps


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "words", [[[7, 8]], [[[7], [8, 2]]], [[7], [8]]], ids=["phrase", "disjunction", "two"]
)
def test_the_forced_words_appear_in_the_best_sequence(words: list[Any], seed: int) -> None:
    constraints = constraints_of(words)
    search = ConstrainedBeamSearch(4, constraints, [1], 8, stop_token_ids=[3])
    drive(search, seed)
    (best,) = search.best(1)
    assert ConstraintListState.of(constraints, [1, *best.token_ids]).completed, best.token_ids
    plain = ConstrainedBeamSearch(4, constraints_of([[9, 9, 9, 9, 9]]), [1], 3, stop_token_ids=[])
    drive(plain, seed)  # a constraint longer than the output cannot be met: the best sequences come back
    assert len(plain.best(2)) == 2


def test_a_beam_that_advances_the_constraints_outranks_better_scores_of_a_lower_bank() -> None:
    def logits(history: list[int]) -> torch.Tensor:
        return torch.log_softmax(torch.tensor([0.0, 5.0, 4.0, 3.0, 0.0, 0.0, 0.0, -3.0, 0.0, 0.0]), dim=-1)

    search = ConstrainedBeamSearch(2, [PhrasalConstraint([7])], [0], 4, stop_token_ids=[])
    first = search.step(torch.stack([logits(b.token_ids) for b in search.running]))
    # token 7 (bank 1) first although 1 and 2 (bank 0) score better; then the best of bank 0
    assert first == [BeamChoice(0, 7), BeamChoice(0, 1)]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(force_words_ids=[[5]]), "force_words_ids"),
        (dict(num_beams=2, force_words_ids=[[]]), "force_words_ids"),
        (dict(num_beams=2, force_words_ids=[[[1, 2], [1]]]), "force_words_ids"),
        (dict(num_beams=2, force_words_ids=[[5]], do_sample=True), "force_words_ids"),
        (dict(num_beams=2, constraints=["x"]), "constraints"),
    ],
)
def test_what_cannot_work_is_refused(options: dict[str, Any], field: str) -> None:
    with pytest.raises(GenerationConfigError) as info:
        GenerationConfig(**options)
    assert info.value.field == field


# ------------------------------------------------------------------------------ in the continuous batch
@pytest.fixture(scope="module")
def tiny(tiny_beam_model: Callable[[str, int], TinyModel]) -> TinyModel:
    return tiny_beam_model("LlamaConfig", 9)


@torch.no_grad()
def scored_on_transformers(model: Any, prompt: list[int], words: list[Any]) -> Any:
    search = ConstrainedBeamSearch(4, constraints_of(words), prompt, 10, [])
    while not search.done:
        rows = [model(torch.tensor([prompt + b.token_ids])).logits[0, -1].float() for b in search.running]
        search.step(torch.log_softmax(torch.stack(rows), dim=-1))
    return search.best(1)


def test_constrained_beams_in_the_batch_equal_the_scoring_on_transformers_logits(tiny: TinyModel) -> None:
    engine = tiny.engine
    words: list[Any] = [[200, 201], [[150], [160, 161]]]
    search = dict(num_beams=4, force_words_ids=words)
    requests = [(p, options_of(search, None)) for p in PROMPTS]
    requests.append(([5, 6, 7], dict(do_sample=False, ignore_eos=True)))
    outputs = run(engine.init_continuous_batching(), requests)
    for prompt, outs in zip(PROMPTS, outputs[:3], strict=True):
        expected = scored_on_transformers(tiny.reference, prompt, words)
        assert [o.generated_ids for o in outs] == [h.token_ids for h in expected]
        assert [o.sequence_score for o in outs] == pytest.approx([h.score for h in expected], abs=1e-4)
        best = outs[0].generated_ids
        assert contains(best, [200, 201])
        assert contains(best, [150]) or contains(best, [160, 161])
