"""User logits processors and stopping criteria through the Python API on the default model: transformers'
own classes and a custom one give transformers' ``generate`` tokens (greedy, token-exact) beside rows that
use none in the same batch, and a processor or criterion that fails fails its request alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from default_engine import engine_on
from torch_threads import one_torch_thread
from transformers import (
    LogitsProcessorList,
    MaxLengthCriteria,
    MinLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    StoppingCriteriaList,
    StopStringCriteria,
)

from engine.engine import Engine
from engine.generation.config import GenerationConfigError
from engine.generation.user_processors import PROCESSOR_FAILED
from engine.loader.model_loader import LoadedModel
from engine.outputs import GenerationOutput, RequestStatus
from scheduler.request import FinishReason

pytestmark = pytest.mark.slow  # the real model, float32

PROMPTS = ["The capital of France is", "Write a short story about a dragon:", "Explain how rain forms."]
NUM_TOKENS = 20


class NoImmediateRepeat:
    """A custom processor: the last token cannot come again at once."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), input_ids[:, -1]] = float("-inf")
        return scores


class StopAfterWords:
    """A custom criterion: stop once the output holds ``count`` tokens that start with a space."""

    def __init__(self, tokenizer: Any, prompt_len: int, count: int) -> None:
        self.tokenizer = tokenizer
        self.prompt_len = prompt_len
        self.count = count

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        pieces = self.tokenizer.convert_ids_to_tokens(input_ids[0, self.prompt_len :].tolist())
        words = sum(1 for p in pieces if p.startswith("Ġ"))
        return torch.full((input_ids.shape[0],), words >= self.count, dtype=torch.bool)


class FailsAtCall:
    """Raises at its ``n``-th call."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError(f"failed at call {self.n}")
        return scores


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Iterator[Engine]:
    yield engine_on(default_model, num_blocks=256)


@pytest.fixture(scope="module")
def prompts(oracle_tokenizer: Any) -> list[list[int]]:
    return [oracle_tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(oracle_model: Any, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens for each prompt without hooks (the same call for every test that needs
    them: computed once)."""
    return [_generate(oracle_model, p) for p in prompts]


@torch.no_grad()
@one_torch_thread()  # see tests/torch_threads.py
def _generate(oracle_model: Any, prompt: list[int], **hooks: Any) -> list[int]:
    ids = torch.tensor([prompt])
    out = oracle_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NUM_TOKENS,
        do_sample=False,
        pad_token_id=0,
        **hooks,
    )
    return [int(t) for t in out[0, len(prompt) :]]


def _run_together(engine: Engine, requests: list[tuple[list[int], dict[str, Any]]]) -> list[GenerationOutput]:
    """Every request in one manager, admitted together so that they share their steps."""
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        ids = [
            manager.add_request(prompt, max_new_tokens=NUM_TOKENS, do_sample=False, **options)
            for prompt, options in requests
        ]
        finals: dict[str, GenerationOutput] = {}
        while len(finals) < len(ids):
            out = manager.get_result(timeout=60)
            assert out is not None, "the engine stopped answering"
            if out.is_finished:
                finals[out.request_id] = out
    finally:
        manager.stop(block=True, timeout=30)
    return [finals[rid] for rid in ids]


def test_transformers_and_custom_hooks_match_generate_beside_plain_rows(
    engine: Engine, oracle_model: Any, oracle_tokenizer: Any, prompts: list[list[int]], plain: list[list[int]]
) -> None:
    eos = oracle_tokenizer.eos_token_id

    def transformers_hooks(i: int) -> dict[str, Any]:
        banned = [[plain[i][0]], oracle_tokenizer.encode(" the", add_special_tokens=False)]
        return {
            "logits_processor": LogitsProcessorList(
                [
                    NoBadWordsLogitsProcessor(banned, eos_token_id=eos),
                    MinLengthLogitsProcessor(len(prompts[i]) + 5, eos_token_id=eos),
                ]
            ),
            "stopping_criteria": StoppingCriteriaList(
                [
                    StopStringCriteria(oracle_tokenizer, ["."]),
                    MaxLengthCriteria(len(prompts[i]) + NUM_TOKENS - 4),
                ]
            ),
        }

    def custom_hooks(i: int) -> dict[str, Any]:
        return {
            "logits_processor": [NoImmediateRepeat()],
            "stopping_criteria": [StopAfterWords(oracle_tokenizer, len(prompts[i]), 3)],
        }

    expected = [
        *plain,
        *(_generate(oracle_model, p, **transformers_hooks(i)) for i, p in enumerate(prompts)),
        *(_generate(oracle_model, p, **custom_hooks(i)) for i, p in enumerate(prompts)),
    ]
    requests = [
        *((p, {}) for p in prompts),
        *((p, transformers_hooks(i)) for i, p in enumerate(prompts)),
        *((p, custom_hooks(i)) for i, p in enumerate(prompts)),
    ]
    outs = _run_together(engine, requests)
    assert [o.status for o in outs] == [RequestStatus.FINISHED] * len(requests)
    assert [o.generated_ids for o in outs] == expected
    n = len(prompts)
    for i in range(n):  # the hooks changed every row that has them
        assert expected[n + i] != plain[i] and expected[2 * n + i] != plain[i]
    custom = [(o.finish_reason, len(o.generated_ids)) for o in outs[2 * n :]]
    # the criterion ended them (the tokens are transformers' anyway), not max_new_tokens
    assert all(reason is FinishReason.STOP for reason, _ in custom), custom


def test_a_failing_hook_fails_its_request_alone(
    engine: Engine, prompts: list[list[int]], plain: list[list[int]]
) -> None:
    def wrong_shape(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores[:, :10]

    def nan_after_three(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores * float("nan") if input_ids.shape[1] >= len(prompts[2]) + 3 else scores

    def criterion_fails(input_ids: torch.Tensor, scores: Any) -> torch.Tensor:
        raise ValueError("no verdict")

    failing: list[tuple[dict[str, Any], str]] = [
        ({"logits_processor": [FailsAtCall(4)]}, "logits_processor[0] (FailsAtCall) failed: RuntimeError"),
        (
            {"logits_processor": [NoImmediateRepeat(), wrong_shape]},
            "logits_processor[1] (wrong_shape) failed",
        ),
        ({"logits_processor": [nan_after_three]}, "returned NaN logits"),
        (
            {"stopping_criteria": [criterion_fails]},
            "stopping_criteria[0] (criterion_fails) failed: ValueError",
        ),
    ]
    requests = [(prompts[i % len(prompts)], hooks) for i, (hooks, _) in enumerate(failing)]
    outs = _run_together(engine, [*requests, *((p, {}) for p in prompts)])
    for out, (_, why) in zip(outs, failing, strict=False):
        assert out.status is RequestStatus.FAILED and out.finish_reason is FinishReason.ERROR
        assert out.error_code == PROCESSOR_FAILED
        assert out.error is not None and why in out.error, out.error
    assert outs[0].generated_ids == plain[0][:3]  # three tokens before the failure
    plain_rows = outs[len(failing) :]
    assert [o.status for o in plain_rows] == [RequestStatus.FINISHED] * len(prompts)
    assert [o.generated_ids for o in plain_rows] == plain


def test_generate_batch_applies_the_hooks_to_every_prompt(
    engine: Engine, oracle_model: Any, prompts: list[list[int]]
) -> None:
    outs = engine.generate_batch(
        prompts,
        max_new_tokens=NUM_TOKENS,
        do_sample=False,
        progress_bar=False,
        logits_processor=[NoImmediateRepeat()],
    )
    ours = [outs[f"batch_req_{i}"].generated_ids for i in range(len(prompts))]
    assert ours == [_generate(oracle_model, p, logits_processor=[NoImmediateRepeat()]) for p in prompts]


def test_logits_processor_args_need_server_processors(engine: Engine, prompts: list[list[int]]) -> None:
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        with pytest.raises(
            GenerationConfigError, match="logits_processor_args: this server loads no logits processors"
        ):
            manager.add_request(prompts[0], logits_processor_args={"ban_token_id": 1})
    finally:
        manager.stop(block=True, timeout=30)
