"""Speculative decoding inside the batch, through the Python API on the default model: outputs equal plain
decoding's token for token (greedy and seeded sampling), alone, batched, under preemption, with stop
strings, max_tokens, grammars and n > 1 landing inside accepted runs; no block is leaked.

The engine runs batch-invariant (float32: the small kernel for every matmul), so that a row's logits are
the same bits in a verify chunk as in a plain decode step on every CPU; equality is then exact."""

from __future__ import annotations

import time
from typing import Any

import pytest
from default_engine import engine_on

from engine.engine import Engine
from engine.generation.config import GenerationConfigError
from engine.generation.grammar_spec import GrammarSpec
from engine.loader.model_loader import LoadedModel
from engine.manager import ContinuousBatchingManager
from engine.outputs import GenerationOutput, RequestStatus
from engine.speculative.config import SpeculativeConfig, SpeculativeConfigError

pytestmark = pytest.mark.slow  # the real model

PASSAGE = (
    "Rewrite this paragraph, fixing the typos: The quick brown fox jumpd over the lazy dog. It was a sunny "
    "day and the fox was very happpy to be outside in the feilds, running and jumping all day long. Then the "
    "fox met a rabbit, and the two of them becamme friends for the rest of the summmer."
)
CODE = (
    "Add type hints to this function and keep everything else as it is:\n"
    "def total_price(items, tax_rate):\n    subtotal = sum(item.price * item.count for item in items)\n"
    "    tax = subtotal * tax_rate\n    return round(subtotal + tax, 2)\n"
)


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Engine:
    engine = engine_on(default_model, num_blocks=512)
    assert engine.batch_invariant
    return engine


def chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def run(
    manager: ContinuousBatchingManager, prompts: list[list[int]], timeout: float = 240, **kw: Any
) -> list[GenerationOutput]:
    """Submit every prompt with ``kw`` and wait for every sample's final output (in submission order)."""
    manager.start()
    n = kw.get("num_return_sequences", 1)
    ids = [manager.add_request(p, **kw) for p in prompts]
    finals: dict[tuple[str, int], GenerationOutput] = {}
    deadline = time.monotonic() + timeout
    while len(finals) < n * len(ids) and time.monotonic() < deadline:
        out = manager.get_result(timeout=1.0)
        if out is not None and out.is_finished:
            finals[(out.request_id, out.index)] = out
    manager.stop(timeout=30)
    assert len(finals) == n * len(ids), "not every request finished in time"
    manager.check_integrity()
    assert manager.scheduler.kv_manager.request_ids == set()  # no table left behind
    return [finals[(rid, i)] for rid in ids for i in range(n)]


def plain_and_speculative(
    engine: Engine, prompts: list[list[int]], server: SpeculativeConfig | None = None, **kw: Any
) -> tuple[list[GenerationOutput], list[GenerationOutput], ContinuousBatchingManager]:
    plain = run(engine.init_continuous_batching(), prompts, **kw)
    manager = engine.init_continuous_batching(speculative_config=server)
    spec_kw = kw if server is not None else {**kw, "prompt_lookup_num_tokens": 4}
    return plain, run(manager, prompts, **spec_kw), manager


def same(a: list[GenerationOutput], b: list[GenerationOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.status is y.status is RequestStatus.FINISHED, (x.error, y.error)
        assert (x.generated_ids, x.text, x.finish_reason) == (y.generated_ids, y.text, y.finish_reason)


def test_greedy_prompt_lookup_equals_plain_decoding_and_accepts_drafts(engine: Engine) -> None:
    prompts = [chat(engine, PASSAGE), chat(engine, CODE)]
    plain, spec, manager = plain_and_speculative(engine, prompts, max_new_tokens=40, output_logprobs=True)
    same(plain, spec)
    for x, y in zip(plain, spec, strict=True):  # the target's logprobs, the same bits
        assert x.logprobs is not None and y.logprobs is not None
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]
    stats = manager.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > stats.spec_num_drafts
    assert manager.num_steps < sum(len(o.generated_ids) for o in spec)  # fewer steps than tokens


def test_prompt_lookup_drafts_a_loop_past_the_end_of_the_sequence(engine: Engine) -> None:
    # the model repeats one token: the latest match of the suffix ends one token before it, and its
    # continuation goes on periodically (four drafts a step, not the one token that follows the match)
    prompts = [engine.tokenizer.encode("Repeat after me: go go go go go go")]
    plain, spec, manager = plain_and_speculative(engine, prompts, max_new_tokens=24, ignore_eos=True)
    same(plain, spec)
    assert len(set(spec[0].generated_ids)) == 1  # what this test is about: a loop of period 1
    stats = manager.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 3 * stats.spec_num_drafts


def test_server_wide_ngram_with_sixteen_concurrent_requests(engine: Engine) -> None:
    prompts = [
        chat(engine, PASSAGE),
        chat(engine, CODE),
        engine.tokenizer.encode("The capital of France is"),
    ] * 6
    server = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "disable_by_batch_size": 64}
    )
    plain, spec, manager = plain_and_speculative(engine, prompts[:16], server, max_new_tokens=24)
    same(plain, spec)
    assert manager.stats().spec_num_accepted_tokens > 0


def test_early_exit_drafts_with_the_first_layers_and_changes_nothing(engine: Engine) -> None:
    prompts = [chat(engine, PASSAGE), engine.tokenizer.encode("The capital of France is")]
    plain = run(engine.init_continuous_batching(), prompts, max_new_tokens=24)
    manager = engine.init_continuous_batching()
    same(plain, run(manager, prompts, max_new_tokens=24, assistant_early_exit=24))
    stats = manager.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    server = SpeculativeConfig.from_dict(
        {"method": "early_exit", "num_layers": 20, "num_speculative_tokens": 2}
    )
    seeded = {"max_new_tokens": 16, "do_sample": True, "seed": 11}
    plain = run(engine.init_continuous_batching(), prompts, **seeded)
    manager = engine.init_continuous_batching(speculative_config=server)
    same(plain, run(manager, prompts, **seeded))
    assert manager.stats().spec_num_drafts > 0
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        with pytest.raises(GenerationConfigError, match="drafting layers must be 1 to 29"):
            manager.add_request(prompts[1], assistant_early_exit=30)
    finally:
        manager.stop(timeout=30)


def test_a_draft_model_follows_every_batch_and_drafts(engine: Engine) -> None:
    prompts = [chat(engine, PASSAGE), engine.tokenizer.encode("The capital of France is")]
    plain = run(engine.init_continuous_batching(), prompts, max_new_tokens=24)
    itself = {"method": "draft_model", "model": "default", "num_speculative_tokens": 4}
    manager = engine.init_continuous_batching(speculative_config=itself)
    same(plain, run(manager, prompts, max_new_tokens=24))
    stats = manager.stats()  # the target drafting for itself: every greedy draft is accepted
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    random_draft = {"method": "draft_model", "model": "smollm2-135m", "load_format": "dummy"}
    seeded = {"max_new_tokens": 16, "do_sample": True, "seed": 5}
    plain = run(engine.init_continuous_batching(), prompts, **seeded)
    manager = engine.init_continuous_batching(speculative_config=random_draft)
    same(plain, run(manager, prompts, **seeded))
    assert manager.stats().spec_num_drafts > 0


def test_speculation_turns_off_above_its_batch_size(engine: Engine) -> None:
    server = SpeculativeConfig.from_dict({"method": "ngram", "disable_by_batch_size": 2})
    prompts = [chat(engine, PASSAGE)] * 4
    manager = engine.init_continuous_batching(speculative_config=server)
    run(manager, prompts, max_new_tokens=12, min_new_tokens=12)
    stats = manager.stats()
    # four requests run together until they all end on the same step: none ever drafted
    assert stats.spec_num_drafts == 0


def test_preemption_with_a_tiny_cache(engine: Engine) -> None:
    small = engine_on(engine.loaded, num_blocks=24)  # the module's batch-invariant model, a tiny cache
    prompts = [chat(small, PASSAGE), chat(small, CODE)] * 2  # ~8 blocks each at the end: 4 do not fit
    plain = run(small.init_continuous_batching(), prompts, max_new_tokens=48)
    manager = small.init_continuous_batching()
    kw = {"prompt_lookup_num_tokens": 5, "num_assistant_tokens_schedule": "constant"}
    spec = run(manager, prompts, max_new_tokens=48, **kw)
    same(plain, spec)
    assert manager.stats().num_preemptions > 0


@pytest.mark.parametrize("max_new_tokens", [5, 17, 30])
def test_max_tokens_inside_an_accepted_run(engine: Engine, max_new_tokens: int) -> None:
    prompts = [chat(engine, PASSAGE)]
    plain, spec, _ = plain_and_speculative(engine, prompts, max_new_tokens=max_new_tokens)
    same(plain, spec)
    assert len(spec[0].generated_ids) == max_new_tokens


def test_stop_strings_and_stop_tokens_inside_an_accepted_run(engine: Engine) -> None:
    prompts = [chat(engine, PASSAGE)]
    (reference,) = run(engine.init_continuous_batching(), prompts, max_new_tokens=40)
    words = reference.text.split()
    stop = " ".join(words[8:10])  # a stop string well inside the copied passage
    stop_id = reference.generated_ids[12]
    plain, spec, _ = plain_and_speculative(engine, prompts, max_new_tokens=40, stop_strings=[stop])
    same(plain, spec)
    assert spec[0].text == reference.text[: reference.text.index(stop)]
    plain, spec, _ = plain_and_speculative(engine, prompts, max_new_tokens=40, stop_token_ids=[stop_id])
    same(plain, spec)
    assert spec[0].generated_ids[-1] == stop_id


def test_seeded_sampling_is_the_same_with_speculation_alone_or_batched(engine: Engine) -> None:
    kw = {"max_new_tokens": 32, "do_sample": True, "temperature": 0.7, "seed": 7}
    prompts = [chat(engine, PASSAGE)]
    plain, spec, manager = plain_and_speculative(engine, prompts, **kw)
    same(plain, spec)
    assert manager.stats().spec_num_accepted_tokens > 0
    others = [chat(engine, CODE), engine.tokenizer.encode("Once upon a time")]
    _, batched, _ = plain_and_speculative(engine, prompts + others, **kw)
    same(plain, batched[:1])


def test_n_samples_and_a_grammar_speculate_too(engine: Engine) -> None:
    prompts = [chat(engine, PASSAGE)]
    kw = {"max_new_tokens": 24, "do_sample": True, "seed": 3, "temperature": 0.5, "num_return_sequences": 3}
    plain, spec, _ = plain_and_speculative(engine, prompts, **kw)
    same(plain, spec)
    regex = GrammarSpec(kind="regex", text=r"The quick brown fox [a-z ]{1,40}\.")
    plain, spec, _ = plain_and_speculative(engine, prompts, max_new_tokens=40, structured_output=regex)
    same(plain, spec)


def test_cancelling_speculating_streams_leaves_nothing(engine: Engine) -> None:
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        ids = [
            manager.add_request(
                chat(engine, PASSAGE), max_new_tokens=200, prompt_lookup_num_tokens=6, streaming=True
            )
            for _ in range(3)
        ]
        deadline = time.monotonic() + 60
        while manager.stats().spec_num_drafts < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        for rid in ids:
            manager.cancel_request(rid)
        finals = 0
        while finals < len(ids) and time.monotonic() < deadline:
            out = manager.get_result(timeout=1.0)
            finals += out is not None and out.is_finished
    finally:
        manager.stop(timeout=30)
    assert finals == len(ids)
    manager.check_integrity()
    assert manager.scheduler.kv_manager.request_ids == set()


class BrokenDrafter:
    def draft(self, *args: object) -> None:
        raise RuntimeError("the draft forward broke")


def test_a_failing_proposer_fails_only_the_requests_it_drafts_for(engine: Engine) -> None:
    manager = engine.init_continuous_batching()
    assert manager.loop.speculator.early_exit is not None
    manager.loop.speculator.early_exit.runner = BrokenDrafter()
    manager.start()
    try:
        drafting = manager.add_request(chat(engine, PASSAGE), max_new_tokens=12, assistant_early_exit=20)
        plain = manager.add_request(chat(engine, PASSAGE), max_new_tokens=12)
        finals: dict[str, GenerationOutput] = {}
        deadline = time.monotonic() + 120
        while len(finals) < 2 and time.monotonic() < deadline:
            out = manager.get_result(timeout=1.0)
            if out is not None and out.is_finished:
                finals[out.request_id] = out
    finally:
        manager.stop(timeout=30)
    assert finals[drafting].status is RequestStatus.FAILED
    assert "speculative decoding (early_exit) failed" in (finals[drafting].error or "")
    assert finals[plain].status is RequestStatus.FINISHED and len(finals[plain].generated_ids) == 12
    manager.check_integrity()
    assert manager.scheduler.kv_manager.request_ids == set()


def test_bad_speculation_options_are_refused(engine: Engine) -> None:
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        prompt = engine.tokenizer.encode("Hi")
        with pytest.raises(GenerationConfigError, match="num_assistant_tokens"):
            manager.add_request(prompt, num_assistant_tokens=3)  # this server does not speculate
        with pytest.raises(GenerationConfigError, match="prompt_lookup_num_tokens"):
            manager.add_request(prompt, prompt_lookup_num_tokens=99)
        with pytest.raises(GenerationConfigError, match="dola_layers"):
            manager.add_request(prompt, prompt_lookup_num_tokens=3, dola_layers="high")
    finally:
        manager.stop(timeout=30)
    for bad, match in (
        ({"method": "medusa"}, "unknown speculative method"),
        ({"num_speculative_tokens": 3}, "needs a method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"method": "ngram", "typo": 1}, "unknown speculative config field 'typo'"),
        ({"method": "early_exit"}, "needs num_layers"),
        ({"method": "ngram", "num_layers": 3}, "num_layers applies to the early_exit method"),
        ({"method": "draft_model"}, "needs model"),
        ({"method": "ngram", "model": "default"}, "needs model"),
    ):
        with pytest.raises(SpeculativeConfigError, match=match):
            SpeculativeConfig.from_dict(bad)
