"""Beam search in the continuous batch (engine/beam_group.py) against transformers' ``generate(num_beams=...)``
on tiny random Llama and Qwen2 models saved as folders: the returned beams token for token, their
``sequences_scores``, alone, beside greedy and sampled requests, and under preemption with a tiny KV cache;
the scheduler's integrity holds after every step and no block is left behind."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from beam_harness import MAX_NEW, PROMPTS, TinyModel, options_of, run

from engine.engine import CacheOptions, Engine
from engine.generation.config import GenerationConfigError
from engine.outputs import GenerationOutput, RequestStatus

SEARCHES: list[dict[str, Any]] = [
    dict(num_beams=4, num_return_sequences=2),
    dict(num_beams=3, num_return_sequences=3, early_stopping=True, length_penalty=0.5),
    dict(num_beams=4, early_stopping="never", length_penalty=2.0),
    dict(num_beams=2, early_stopping=False, length_penalty=-1.0, repetition_penalty=1.3),
    dict(num_beams=5, num_return_sequences=5, no_repeat_ngram_size=2, min_new_tokens=3),
]


@pytest.fixture(scope="module", params=["LlamaConfig", "Qwen2Config"])
def tiny(request: pytest.FixtureRequest, tiny_beam_model: Callable[[str, int], TinyModel]) -> TinyModel:
    return tiny_beam_model(request.param, 3)


@pytest.fixture(scope="module")
def model(tiny: TinyModel) -> Any:
    return tiny.reference


@pytest.fixture(scope="module")
def engine(tiny: TinyModel) -> Engine:
    return tiny.engine


@pytest.fixture(scope="module")
def eos(model: Any) -> int:
    """A token the beams of the first prompt generate early: as EOS, it ends some hypotheses early."""
    return reference(model, PROMPTS[0], None, dict(num_beams=4))[0][0][2]


@torch.no_grad()
def reference(
    model: Any, prompt: list[int], eos: int | None, search: dict[str, Any]
) -> tuple[list[list[int]], list[float]]:
    """transformers' returned beams (each cut at its own length) and their ``sequences_scores``."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        **search,
    )
    beams = []
    for row, indices in zip(out.sequences, out.beam_indices, strict=True):
        length = int((indices >= 0).sum())
        beams.append(row[len(prompt) : len(prompt) + length].tolist())
    return beams, out.sequences_scores.tolist()


def assert_same(outputs: list[GenerationOutput], expected: tuple[list[list[int]], list[float]]) -> None:
    beams, scores = expected
    assert [o.generated_ids for o in outputs] == beams
    assert [o.sequence_score for o in outputs] == pytest.approx(scores, abs=1e-4)


@pytest.mark.parametrize("with_eos", [False, True])
@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_beams_equal_transformers(
    engine: Engine, model: Any, eos: int, search: dict[str, Any], with_eos: bool
) -> None:
    stop = eos if with_eos else None
    outputs = run(engine.init_continuous_batching(), [(p, options_of(search, stop)) for p in PROMPTS])
    for prompt, outs in zip(PROMPTS, outputs, strict=True):
        assert_same(outs, reference(model, prompt, stop, search))
        for out in outs:
            ends_on_eos = with_eos and out.generated_ids[-1] == eos
            assert out.finish_reason.value == ("stop" if ends_on_eos else "length")


def test_beams_beside_greedy_and_sampled_requests_equal_alone(engine: Engine, model: Any, eos: int) -> None:
    search = SEARCHES[0]
    neighbours: list[tuple[list[int], dict[str, Any]]] = [
        ([5, 6, 7, 8], dict(do_sample=False, ignore_eos=True)),
        ([9, 10], dict(do_sample=True, temperature=0.9, seed=7, ignore_eos=True)),
        ([11, 12, 13], dict(do_sample=True, seed=1, num_return_sequences=2, ignore_eos=True)),
        ([5, 6, 7, 5, 6, 7, 5, 6], dict(do_sample=False, ignore_eos=True, prompt_lookup_num_tokens=3)),
    ]
    beams = [(p, options_of(search, eos)) for p in PROMPTS]
    mixed = [neighbours[0], beams[0], neighbours[1], beams[1], neighbours[2], beams[2], neighbours[3]]
    outputs = run(engine.init_continuous_batching(), mixed)
    for prompt, outs in zip(PROMPTS, outputs[1::2], strict=True):
        assert_same(outs, reference(model, prompt, eos, search))
    alone = run(engine.init_continuous_batching(), neighbours)
    for together, by_itself in zip(outputs[0::2], alone, strict=True):
        assert [o.generated_ids for o in together] == [o.generated_ids for o in by_itself]


def test_a_tiny_cache_preempts_whole_searches_and_leaks_nothing(engine: Engine, model: Any) -> None:
    small = Engine(engine.loaded, CacheOptions(num_blocks=24, block_size=4, max_batch_tokens=32), "small")
    search = dict(num_beams=3, num_return_sequences=2)
    requests = [(p, options_of(search, None)) for p in PROMPTS[:2]] * 2
    requests.append(([30, 31, 32, 33, 34], dict(do_sample=False, ignore_eos=True)))
    manager = small.init_continuous_batching(safety_margin=0.0)
    outputs = run(manager, requests)
    assert manager.scheduler.num_preemptions > 0
    for (prompt, _), outs in zip(requests[:4], outputs[:4], strict=True):
        assert_same(outs, reference(model, prompt, None, search))


def test_output_logprobs_are_the_beams_per_token_scores(engine: Engine, model: Any) -> None:
    prompt = PROMPTS[0]
    search = dict(num_beams=3, num_return_sequences=2, length_penalty=0.0)
    (outs,) = run(
        engine.init_continuous_batching(), [(prompt, {**options_of(search, None), "output_logprobs": True})]
    )
    for out in outs:
        assert out.logprobs is not None and len(out.logprobs) == len(out.generated_ids)
        assert [lp.token_id for lp in out.logprobs] == out.generated_ids
        # length_penalty 0: the score is the sum of the tokens' log-probabilities
        assert sum(lp.logprob for lp in out.logprobs) == pytest.approx(out.sequence_score, abs=1e-4)


def test_generate_batch_returns_the_best_first(engine: Engine, model: Any) -> None:
    search = dict(num_beams=4, num_return_sequences=3)
    res = engine.generate_batch(
        [PROMPTS[1]], progress_bar=False, max_new_tokens=MAX_NEW, **options_of(search, None)
    )
    outs = [res["batch_req_0"], res["batch_req_0/1"], res["batch_req_0/2"]]
    assert_same(outs, reference(model, PROMPTS[1], None, search))
    assert outs[0].sequence_score >= outs[1].sequence_score >= outs[2].sequence_score


def test_cancelling_a_search_frees_every_beam(engine: Engine) -> None:
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        rid = manager.add_request(
            PROMPTS[2], max_new_tokens=200, num_beams=4, num_return_sequences=2, ignore_eos=True
        )
        while manager.num_steps < 3:
            threading.Event().wait(0.01)
        manager.cancel_request(rid)
        outs = [manager.get_result(timeout=30) for _ in range(2)]
    finally:
        manager.stop(timeout=30)
    assert sorted(o.index for o in outs if o is not None) == [0, 1]
    assert all(o is not None and o.status is RequestStatus.CANCELLED for o in outs)
    manager.check_integrity()
    assert manager.scheduler.kv_manager.num_free_blocks == manager.scheduler.num_blocks


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
        (dict(num_beams=0), "num_beams"),
        (dict(num_beams=2, early_stopping="sometimes"), "early_stopping"),
        (dict(num_beams=2, stop_strings=["x"]), "stop_strings"),
        (dict(num_beams=2, max_time=1.0), "max_time"),
        (dict(num_beams=100), "num_beams"),
        (dict(num_beams=2, prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(num_beams=2, assistant_early_exit=1), "assistant_early_exit"),
    ],
)
def test_what_beams_cannot_do_is_refused(engine: Engine, options: dict[str, Any], field: str) -> None:
    manager = engine.init_continuous_batching(max_num_seqs=8)
    manager.start()
    try:
        with pytest.raises(GenerationConfigError) as info:
            manager.add_request(PROMPTS[0], max_new_tokens=4, **options)
    finally:
        manager.stop(timeout=30)
    assert info.value.field == field


SAMPLED_SEARCHES: list[dict[str, Any]] = [
    dict(num_beams=4, num_return_sequences=2, temperature=0.7),
    dict(num_beams=3, top_k=5, temperature=1.3),
    dict(num_beams=3, top_p=0.9, temperature=0.5, early_stopping=True),
]


@torch.no_grad()
def sampled_reference(model: Any, prompt: list[int], seed: int, search: dict[str, Any]) -> list[list[int]]:
    """transformers' beam sampling, its draws from the torch generator seeded with ``seed``."""
    torch.manual_seed(seed)
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_NEW,
        do_sample=True,
        eos_token_id=None,
        pad_token_id=0,
        **search,
    )
    return [row[len(prompt) :].tolist() for row in out]


@pytest.mark.parametrize("search", SAMPLED_SEARCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_beam_sampling_equals_transformers_seeded_alone_and_batched(
    engine: Engine, model: Any, search: dict[str, Any]
) -> None:
    options = {**search, "do_sample": True, "seed": 11, "ignore_eos": True}
    neighbour = ([9, 10], dict(do_sample=True, temperature=0.9, seed=7, ignore_eos=True))
    together = run(engine.init_continuous_batching(), [neighbour, *[(p, options) for p in PROMPTS]])[1:]
    alone = run(engine.init_continuous_batching(), [(PROMPTS[1], options)])
    assert [o.generated_ids for o in alone[0]] == [o.generated_ids for o in together[1]]
    for prompt, outs in zip(PROMPTS, together, strict=True):
        assert [o.generated_ids for o in outs] == sampled_reference(model, prompt, 11, search)
    other_seed = run(engine.init_continuous_batching(), [(PROMPTS[1], {**options, "seed": 12})])
    assert [o.generated_ids for o in other_seed[0]] != [o.generated_ids for o in alone[0]]
