"""A request's logits do not depend on what shares its steps: through the continuous-batching manager on
the default model, two prompts' logprobs (a short greedy one, a long seeded one) alone are the same bits as
side by side beside long prefill chunks, inside a decode batch of 16 rows, and when the long one is split
into chunks by an earlier long prompt (docs/GENERATION.md, "Batch invariance"): float32 on every CPU by
default (the small kernel takes every call); bfloat16 where the CPU has AMX-BF16 or AVX512-BF16 by default
(the AMX kernel, else the dot-product kernel, takes every call), and with ``batch_invariant=True`` on the
path of AVX2-only CPUs (float32 chains on the small kernel over the bfloat16 weights; those kernels are
hidden from the loader here).

The prompts are sized against the engine's step budget: float32's steps hold ``STEP_TOKENS`` tokens, so a
step still mixes prefill chunks of hundreds of rows with decode rows and a prompt is still split by one
before it, at a quarter of the prefill work; bfloat16's hold the server's default 2,048 (prefill steps of
more than the ~1,300 rows where oneDNN would be as fast as the AMX kernel)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from default_engine import engine_on

from engine.cpu.native_build import KernelUnavailable
from engine.engine import Engine
from engine.executor import fast_paths
from engine.executor.kernels import amx_gemm, bf16_gemm
from engine.executor.kernels.modules import WidenedLinear
from engine.outputs import GenerationOutput

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
STEP_TOKENS = 512  # max_batch_tokens: prefill calls of hundreds of rows beside the decode rows
BF16_STEP_TOKENS = 2048


def _random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(length)]


def _engine(dtype: str, request: pytest.FixtureRequest) -> tuple[Engine, int]:
    """The engine and its step budget."""
    if dtype == "float32":  # the session's default float32 load: no batch_invariant, it promises it
        return engine_on(request.getfixturevalue("default_model"), max_batch_tokens=STEP_TOKENS), STEP_TOKENS
    if dtype == "bfloat16-widened":  # what an AVX2-only CPU runs with batch_invariant
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fast_paths, "_amx", lambda model: None)
            patch.setattr(fast_paths, "_bf16_dot", lambda model: None)
            engine = Engine.from_pretrained(
                "default", device="cpu", dtype="bfloat16", batch_invariant=True, max_batch_tokens=STEP_TOKENS
            )
        assert isinstance(engine.model.lm_head, WidenedLinear)
        return engine, STEP_TOKENS
    try:
        amx_gemm.load()
    except KernelUnavailable as e:
        try:
            bf16_gemm.load()
        except KernelUnavailable as e2:
            pytest.skip(f"batch-invariant bfloat16 by default needs AMX-BF16 ({e}) or AVX512-BF16 ({e2})")
    # NOTE: no batch_invariant: the default bfloat16 kernels on AMX or AVX512-BF16 promise it (the session's
    # load: Engine.from_pretrained("default", device="cpu", dtype="bfloat16")'s model, tests/conftest.py)
    engine = engine_on(request.getfixturevalue("default_model_bf16"), max_batch_tokens=BF16_STEP_TOKENS)
    return engine, BF16_STEP_TOKENS


def _outputs(
    engine: Engine, batch: list[tuple[list[int], dict[str, Any]]]
) -> list[tuple[list[int], torch.Tensor]]:
    """Every (prompt, sampling) of ``batch`` added at once; each one's tokens and their logprobs."""
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        ids = [
            manager.add_request(
                prompt, max_new_tokens=NEW_TOKENS, output_logprobs=True, ignore_eos=True, **sampling
            )
            for prompt, sampling in batch
        ]
        finals: dict[str, GenerationOutput] = {}
        while len(finals) < len(batch):
            out = manager.get_result(timeout=1.0)
            if out is None:
                assert manager.is_running(), "the engine loop stopped before every request finished"
            elif out.is_finished:
                finals[out.request_id] = out
    finally:
        manager.stop(block=True, timeout=30)
    results = []
    for rid in ids:
        out = finals[rid]
        assert out.logprobs is not None and len(out.generated_ids) == NEW_TOKENS
        results.append(
            (out.generated_ids, torch.tensor([lp.logprob for lp in out.logprobs], dtype=torch.float64))
        )
    return results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16-widened"])
def test_logprobs_are_the_same_bits_whatever_shares_the_steps(
    dtype: str, request: pytest.FixtureRequest
) -> None:
    engine, step_tokens = _engine(dtype, request)
    assert engine.batch_invariant
    rng = random.Random(0)
    greedy, seeded = {"do_sample": False}, {"do_sample": True, "seed": 7, "temperature": 1.0}
    # a short greedy prompt and a long seeded one, checked side by side in every batch
    checked = [
        (engine.tokenizer.encode("Once upon a time, in a small village by the sea, there lived"), greedy),
        (_random_prompt(rng, step_tokens * 3 // 10), seeded),
    ]
    # their chunks fill the steps
    long_prompts = [_random_prompt(rng, step_tokens * 6 // 10) for _ in range(2)]
    decoding = [_random_prompt(rng, 20) for _ in range(14)]  # with the two: a decode batch of 16 rows
    # takes most of a step: the long prompt after it is split in two
    first_long = _random_prompt(rng, step_tokens * 9 // 10)
    alone = [_outputs(engine, [request])[0] for request in checked]
    for before, after in (
        ([], [(p, greedy) for p in long_prompts]),
        ([], [(p, greedy) for p in decoding]),
        ([(first_long, greedy)], []),
    ):
        outputs = _outputs(engine, [*before, *checked, *after])[len(before) : len(before) + len(checked)]
        for (ids, logprobs), (alone_ids, alone_logprobs) in zip(outputs, alone, strict=True):
            assert ids == alone_ids
            assert torch.equal(logprobs, alone_logprobs), (
                dtype,
                len(before) + len(checked) + len(after),
                (logprobs - alone_logprobs).abs().max().item(),
            )


def test_batch_invariance_is_refused_where_the_kernels_cannot_promise_it() -> None:
    with pytest.raises(ValueError, match="attention backend"):
        Engine.from_pretrained(
            "default", device="cpu", dtype="float32", attention_backend="sdpa", batch_invariant=True
        )
    with pytest.raises(ValueError, match="transformers backend"):
        Engine.from_pretrained("default", device="cpu", model_impl="transformers", batch_invariant=True)
