"""A request's logits do not depend on what shares its steps: through ``Engine.generate_batch`` on the
default model, a prompt's logprobs alone are the same bits as beside long prefill chunks, inside a full
decode batch, and when its own prompt is split into chunks by an earlier long prompt (docs/GENERATION.md,
"Batch invariance"). With ``batch_invariant=True``: float32 on every CPU (the small kernel for every call),
bfloat16 where the CPU has AMX-BF16 (the AMX kernel for every call)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.cpu.native_build import KernelUnavailable
from engine.engine import Engine
from engine.executor.kernels import amx_gemm

pytestmark = pytest.mark.slow

NEW_TOKENS = 12


def _random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(length)]


def _engine(dtype: str) -> Engine:
    if dtype == "bfloat16":
        try:
            amx_gemm.load()
        except KernelUnavailable as e:
            pytest.skip(f"batch-invariant bfloat16 needs AMX-BF16: {e}")
    return Engine.from_pretrained("default", device="cpu", dtype=dtype, batch_invariant=True)


def _first_output(
    engine: Engine, batch: list[list[int]], index: int, **sampling: object
) -> tuple[list[int], torch.Tensor]:
    results = engine.generate_batch(
        batch,
        progress_bar=False,
        max_new_tokens=NEW_TOKENS,
        output_logprobs=True,
        ignore_eos=True,
        **sampling,
    )
    out = results[f"batch_req_{index}"]
    assert out.logprobs is not None and len(out.generated_ids) == NEW_TOKENS
    return out.generated_ids, torch.tensor([lp.logprob for lp in out.logprobs], dtype=torch.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_are_the_same_bits_whatever_shares_the_steps(dtype: str) -> None:
    engine = _engine(dtype)
    assert engine.batch_invariant
    rng = random.Random(0)
    prompts = [
        engine.tokenizer.encode("Once upon a time, in a small village by the sea, there lived"),
        _random_prompt(rng, 600),
    ]
    long_prompts = [_random_prompt(rng, 1200) for _ in range(2)]  # their chunks fill the 2,048-token steps
    decoding = [_random_prompt(rng, 20) for _ in range(15)]  # a full decode batch beside the prompt
    first_long = _random_prompt(rng, 1800)  # takes most of a step: the prompt after it is split in two
    greedy, seeded = {"do_sample": False}, {"do_sample": True, "seed": 7, "temperature": 1.0}
    for prompt, sampling in ((prompts[0], greedy), (prompts[1], seeded)):
        alone_ids, alone = _first_output(engine, [prompt], 0, **sampling)
        for batch, index in (
            ([prompt, *long_prompts], 0),
            ([prompt, *decoding], 0),
            ([first_long, prompt], 1),
        ):
            ids, logprobs = _first_output(engine, batch, index, **sampling)
            assert ids == alone_ids
            assert torch.equal(logprobs, alone), (
                dtype,
                len(batch),
                (logprobs - alone).abs().max().item(),
            )


def test_batch_invariance_is_refused_where_the_kernels_cannot_promise_it() -> None:
    with pytest.raises(ValueError, match="cpu attention backend"):
        Engine.from_pretrained(
            "default", device="cpu", dtype="float32", attention_backend="sdpa", batch_invariant=True
        )
    with pytest.raises(ValueError, match="transformers backend"):
        Engine.from_pretrained("default", device="cpu", model_impl="transformers", batch_invariant=True)
