"""User logits processors and stopping criteria on scripted logits (no model): transformers' own classes
give transformers' result per row, rows without processors are untouched, the pipeline place (after
cbserve's processors, before the warpers), failures fail only their rows, and the loading of server
processors by spec."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MaxLengthCriteria,
    MinLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)
from user_processor_fixtures import BanToken

from engine.generation.config import GenerationConfig, GenerationConfigError
from engine.generation.processor_plugins import ENTRY_POINT_GROUP, ProcessorLoadError, load_logits_processors
from engine.generation.request_state import RequestGenerationState
from engine.generation.rng import RequestRNG
from engine.generation.rows import SamplingRow
from engine.generation.sampler import Sampler
from engine.generation.user_processors import PROCESSOR_FAILED, RequestHooks, StoppingCriterionError
from scheduler.request import FinishReason

V = 64
EOS = 2
PROMPT = [5, 6, 7]


class CharDecoder:
    """Token ``t`` is the character ``chr(65 + t % 26)``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(65 + t % 26) for t in ids)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((rows, V), generator=g) * 3.0  # [rows, V]


def _row(output: list[int] | None = None, hooks: RequestHooks | None = None, **cfg: Any) -> SamplingRow:
    return SamplingRow(GenerationConfig(**cfg), PROMPT, list(output or []), RequestRNG(None), hooks=hooks)


def _hooks(*processors: Any) -> RequestHooks:
    hooks = RequestHooks.of(list(processors), None)
    assert hooks is not None
    return hooks


class Recorder:
    """Keeps the scores it is given, changes nothing."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.input_ids: list[list[int]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.seen.append(scores.clone())
        self.input_ids.append(input_ids[0].tolist())
        return scores


# ---------------------------------------------------------------------------------------- request processors
def test_transformers_processors_give_their_own_result_per_row() -> None:
    output = [9, 11]
    processors = [
        NoBadWordsLogitsProcessor([[11, 3], [4]], eos_token_id=EOS),
        MinLengthLogitsProcessor(min_length=8, eos_token_id=EOS),
        RepetitionPenaltyLogitsProcessor(1.7),
    ]
    logits = _logits(3, seed=1)
    expected = LogitsProcessorList(processors)(torch.tensor([PROMPT + output]), logits[1:2].clone())
    recorder = Recorder()
    rows = [_row(output), _row(output, _hooks(*processors, recorder)), _row(output, top_k=0)]
    tokens = Sampler(V, eos_token_ids=(EOS,)).sample(logits.clone(), rows)
    torch.testing.assert_close(recorder.seen[0], expected, rtol=0, atol=0)
    assert recorder.input_ids == [PROMPT + output]
    assert tokens[1].token_id == int(expected.argmax())
    assert tokens[0].token_id == int(logits[0].argmax()) and tokens[2].token_id == int(logits[2].argmax())


def test_user_processors_run_after_cbserves_own_and_before_the_warpers() -> None:
    recorder = Recorder()
    logits = _logits(1, seed=2)
    row = _row(hooks=_hooks(recorder), suppress_tokens=[1], do_sample=True, temperature=0.5, top_k=0, seed=3)
    Sampler(V).sample(logits.clone(), [row])
    seen = recorder.seen[0][0]
    assert seen[1] == float("-inf")  # suppress_tokens ran before
    others = torch.arange(V) != 1
    torch.testing.assert_close(seen[others], logits[0][others], rtol=0, atol=0)  # temperature did not


def test_a_failing_request_processor_fails_only_its_row() -> None:
    def boom(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("broken")

    def wrong_shape(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores[:, :-1]

    def nan(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores * float("nan")

    def not_a_tensor(input_ids: torch.Tensor, scores: torch.Tensor) -> Any:
        return scores.tolist()

    logits = _logits(5, seed=4)
    rows = [_row(), _row(hooks=_hooks(boom)), _row(hooks=_hooks(wrong_shape)), _row(hooks=_hooks(nan))]
    rows.append(_row(hooks=_hooks(not_a_tensor)))
    tokens = Sampler(V).sample(logits.clone(), rows)
    assert tokens[0].error is None and tokens[0].token_id == int(logits[0].argmax())
    for tok, why in zip(
        tokens[1:],
        [
            "RuntimeError('broken')",
            "returned shape (1, 63), expected (1, 64)",
            "returned NaN logits",
            "not a tensor",
        ],
        strict=True,
    ):
        assert tok.token_id == -1 and tok.error_code == PROCESSOR_FAILED
        assert tok.error is not None and "logits_processor[0]" in tok.error and why in tok.error


def test_hooks_reject_objects_that_cannot_be_called() -> None:
    with pytest.raises(GenerationConfigError, match="logits_processor"):
        RequestHooks.of([42], None)
    with pytest.raises(GenerationConfigError, match="stopping_criteria"):
        RequestHooks.of(None, ["stop"])
    assert RequestHooks.of(None, None) is None
    assert RequestHooks.of([], []) is None


# ---------------------------------------------------------------------------------------- stopping criteria
def _state(hooks: RequestHooks, **cfg: Any) -> RequestGenerationState:
    return RequestGenerationState(GenerationConfig(**cfg), PROMPT, CharDecoder(), (EOS,), hooks=hooks)


def test_a_stopping_criterion_ends_the_sequence_with_its_token() -> None:
    hooks = RequestHooks.of(None, [MaxLengthCriteria(max_length=len(PROMPT) + 3)])
    assert hooks is not None
    state = _state(hooks)
    assert [state.on_token(t).finish_reason for t in (10, 11, 12)] == [None, None, FinishReason.STOP]
    assert state.output_ids == [10, 11, 12] and state.text == "KLM"


def test_min_new_tokens_holds_a_stopping_criterion_back() -> None:
    hooks = RequestHooks.of(None, [MaxLengthCriteria(max_length=len(PROMPT) + 1)])
    assert hooks is not None
    state = _state(hooks, min_new_tokens=3)
    assert [state.on_token(t).finish_reason for t in (10, 11, 12)] == [None, None, FinishReason.STOP]


@pytest.mark.parametrize(
    ("criterion", "why"),
    [
        (lambda ids, scores: torch.tensor([1, 0]), "not one bool"),
        (lambda ids, scores: "yes", "not a bool"),
        (lambda ids, scores: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_a_broken_stopping_criterion_raises_a_clear_error(criterion: Any, why: str) -> None:
    hooks = RequestHooks.of(None, [criterion])
    assert hooks is not None
    with pytest.raises(StoppingCriterionError, match=why):
        _state(hooks).on_token(10)


# ---------------------------------------------------------------------------------------- server processors
def test_server_processor_touches_only_rows_with_args() -> None:
    processors = load_logits_processors(["user_processor_fixtures:BanToken"], None, V)
    logits = _logits(3, seed=5)
    top = [int(r.argmax()) for r in logits]
    rows = [_row(), _row(logits_processor_args={"ban_token_id": top[1]}), _row(logits_processor_args={})]
    tokens = Sampler(V, logits_processors=processors).sample(logits.clone(), rows)
    assert [t.error for t in tokens] == [None, None, None]
    assert tokens[0].token_id == top[0] and tokens[2].token_id == top[2]
    assert tokens[1].token_id == int(logits[1].topk(2).indices[1])


def test_a_failing_server_processor_fails_only_the_rows_that_fail_alone() -> None:
    processors = [("ban", BanToken(None, V))]
    logits = _logits(4, seed=6)
    top = [int(r.argmax()) for r in logits]
    rows = [
        _row(logits_processor_args={"ban_token_id": top[0]}),
        _row(logits_processor_args={"fail": True}),
        _row(),
        _row(logits_processor_args={"nan": True}),
    ]
    tokens = Sampler(V, logits_processors=processors).sample(logits.clone(), rows)
    assert tokens[0].error is None and tokens[0].token_id == int(logits[0].topk(2).indices[1])
    assert tokens[2].error is None and tokens[2].token_id == top[2]
    assert tokens[1].error_code == tokens[3].error_code == PROCESSOR_FAILED
    assert (
        tokens[1].error is not None
        and "logits processor ban failed: RuntimeError('asked to fail')" in tokens[1].error
    )
    assert tokens[3].error is not None and "NaN" in tokens[3].error


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("no_such_module_anywhere:Thing", "cannot import 'no_such_module_anywhere'"),
        ("user_processor_fixtures:Missing", "has no attribute 'Missing'"),
        ("user_processor_fixtures:NOT_A_CLASS", "not a class"),
        ("user_processor_fixtures:FailsToBuild", "FailsToBuild(tokenizer, vocab_size) failed"),
        ("user_processor_fixtures:TakesOnlyLogits", "must take (rows, logits)"),
        ("user_processor_fixtures:NotCallable", "has no __call__"),
        ("no-such-entry-point", "no entry point of that name in the group 'cbserve.logits_processors'"),
        (":Class", "expected 'package.module:Class'"),
    ],
)
def test_a_spec_that_cannot_be_used_says_why(spec: str, why: str) -> None:
    with pytest.raises(ProcessorLoadError) as exc:
        load_logits_processors([spec], None, V)
    assert why in str(exc.value) and repr(spec) in str(exc.value)


def test_a_spec_named_twice_is_refused() -> None:
    spec = "user_processor_fixtures:BanToken"
    with pytest.raises(ProcessorLoadError, match="named twice"):
        load_logits_processors([spec, spec], None, V)


def test_an_entry_point_names_a_processor(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = importlib.metadata.EntryPoints(
        [
            importlib.metadata.EntryPoint("ban", "user_processor_fixtures:BanToken", ENTRY_POINT_GROUP),
            importlib.metadata.EntryPoint("gone", "no_such_module_anywhere:Thing", ENTRY_POINT_GROUP),
        ]
    )
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: installed.select(group=group))
    [(name, processor)] = load_logits_processors(["ban"], None, V)
    assert name == "ban" and isinstance(processor, BanToken) and processor.vocab_size == V
    with pytest.raises(
        ProcessorLoadError, match="'gone': entry point 'no_such_module_anywhere:Thing' fails to load"
    ):
        load_logits_processors(["gone"], None, V)
    with pytest.raises(ProcessorLoadError, match=r"no entry point of that name .* \(ban, gone\)"):
        load_logits_processors(["other"], None, V)
