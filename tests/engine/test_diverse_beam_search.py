"""Diverse beam search (engine/generation/diverse_beam_search.py): the algorithm's definition on scripted
logits (the groups choose apart, a group of one beam is a greedy search under the penalty, hypotheses are
kept and ranked as transformers' group beam search keeps them), and in the continuous batch on a tiny random
model the same beams as the scoring driven by transformers' own forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from beam_harness import PROMPTS, TinyModel, options_of, run

from engine.generation.config import GenerationConfig, GenerationConfigError
from engine.generation.diverse_beam_search import DiverseBeamSearch

VOCAB = 10


def table_logits(history: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + sum((i + 1) * t for i, t in enumerate(history[-3:])))
    return torch.log_softmax(torch.randn(VOCAB, generator=g) * 2.0, dim=-1)


def drive(search: DiverseBeamSearch, logits: Any) -> int:
    steps = 0
    while not search.done:
        search.step(torch.stack([logits(b.token_ids) for b in search.running]))
        steps += 1
    return steps


@pytest.mark.parametrize("seed", range(5))
def test_groups_of_one_beam_are_greedy_searches_under_the_hamming_penalty(seed: int) -> None:
    num_groups, penalty, max_new = 3, 0.7, 6
    search = DiverseBeamSearch(
        num_groups, num_groups, penalty, max_new, stop_token_ids=[], length_penalty=0.0
    )
    assert drive(search, lambda h: table_logits(h, seed)) == max_new
    # the definition, written out: group g takes the argmax of its log-probabilities less `penalty` per
    # earlier group that chose the token at this step
    paths: list[list[int]] = [[] for _ in range(num_groups)]
    for _ in range(max_new):
        chosen: list[int] = []
        for path in paths:
            scores = table_logits(path, seed) - penalty * torch.bincount(
                torch.tensor(chosen, dtype=torch.int64), minlength=VOCAB
            )
            path.append(int(scores.argmax()))
            chosen.append(path[-1])
    best = search.best(num_groups)
    assert sorted(h.token_ids for h in best) == sorted(paths)
    assert [h.score for h in best] == sorted((h.score for h in best), reverse=True)


def test_a_large_penalty_makes_every_group_choose_apart() -> None:
    search = DiverseBeamSearch(4, 4, 1e6, 5, stop_token_ids=[])
    drive(search, lambda h: table_logits(h, 3))
    beams = [h.token_ids for h in search.best(4)]
    for position in range(5):
        assert len({b[position] for b in beams}) == 4
    plain = DiverseBeamSearch(4, 1, 0.0, 5, stop_token_ids=[])
    drive(plain, lambda h: table_logits(h, 3))
    assert (
        len({b[0] for b in (h.token_ids for h in plain.best(4))}) < 4
    )  # without groups, beams share a start


def test_eos_hypotheses_and_early_stopping_per_group() -> None:
    # token 9 ends a beam; each group of 2 keeps its 2 best hypotheses and is done at once with early_stopping
    def logits(history: list[int]) -> torch.Tensor:
        row = torch.full((VOCAB,), -20.0)
        row[9] = -0.1 if len(history) >= 1 else -3.0
        row[history[-1] if history else 0] = -1.0 if history else -0.5
        row[1 + len(history) % 5] = -1.5
        return row

    search = DiverseBeamSearch(4, 2, 0.5, 8, stop_token_ids=[9], length_penalty=1.0, early_stopping=True)
    steps = drive(search, logits)
    assert steps < 8  # every group finished its hypotheses before the length limit
    best = search.best(4)
    assert all(h.token_ids[-1] == 9 for h in best)
    assert all(
        h.score == pytest.approx(sum(lp.logprob for lp in h.logprobs) / len(h.token_ids)) for h in best
    )


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(num_beams=4, num_beam_groups=3, diversity_penalty=1.0), "num_beam_groups"),
        (dict(num_beams=4, num_beam_groups=2), "diversity_penalty"),
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0, do_sample=True), "do_sample"),
        (dict(num_beams=4, num_beam_groups=0), "num_beam_groups"),
        (dict(num_beams=4, diversity_penalty=-1.0), "diversity_penalty"),
    ],
)
def test_what_cannot_work_is_refused(options: dict[str, Any], field: str) -> None:
    with pytest.raises(GenerationConfigError) as info:
        GenerationConfig(**options)
    assert info.value.field == field


# ------------------------------------------------------------------------------ in the continuous batch
@pytest.fixture(scope="module")
def tiny(tiny_beam_model: Callable[[str, int], TinyModel]) -> TinyModel:
    return tiny_beam_model("LlamaConfig", 5)


@torch.no_grad()
def scored_on_transformers(model: Any, prompt: list[int], search: dict[str, Any], eos: int | None) -> Any:
    beams = DiverseBeamSearch(
        search["num_beams"], search["num_beam_groups"], search["diversity_penalty"], 10,
        [eos] if eos is not None else [], search.get("length_penalty", 1.0), search.get("early_stopping", False),
    )  # fmt: skip
    drive(beams, lambda h: torch.log_softmax(model(torch.tensor([prompt + h])).logits[0, -1].float(), dim=-1))
    return beams.best(search.get("num_return_sequences", 1))


SEARCH: dict[str, Any] = dict(
    num_beams=6, num_beam_groups=3, diversity_penalty=1.5, num_return_sequences=4, length_penalty=0.8
)


@pytest.mark.parametrize("with_eos", [False, True])
def test_diverse_beams_in_the_batch_equal_the_scoring_on_transformers_logits(
    tiny: TinyModel, with_eos: bool
) -> None:
    # as EOS: a token the search generates early, so that it ends some hypotheses
    eos = (
        scored_on_transformers(tiny.reference, PROMPTS[0], SEARCH, None)[0].token_ids[2] if with_eos else None
    )
    engine = tiny.engine
    requests = [(p, options_of(SEARCH, eos)) for p in PROMPTS]
    requests.append(([5, 6, 7], dict(do_sample=True, seed=3, ignore_eos=True)))
    outputs = run(engine.init_continuous_batching(), requests)
    for prompt, outs in zip(PROMPTS, outputs[:3], strict=True):
        expected = scored_on_transformers(tiny.reference, prompt, SEARCH, eos)
        assert [o.generated_ids for o in outs] == [h.token_ids for h in expected]
        assert [o.sequence_score for o in outs] == pytest.approx([h.score for h in expected], abs=1e-4)
    if with_eos:
        assert any(o.generated_ids[-1] == eos for outs in outputs[:3] for o in outs)
