"""Beam search on the default model against transformers' ``generate(num_beams=...)`` on the same GGUF
(dequantized, float32: the greedy parity tests' oracle), with and without EOS, alone and in one batch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from default_engine import engine_on
from torch_threads import one_torch_thread

from engine.engine import Engine
from engine.loader.model_loader import LoadedModel
from engine.outputs import GenerationOutput

PROMPTS = ["The capital of France is", "Here is a short poem about the sea:", "def fibonacci(n):"]
MAX_NEW = 16
SEARCHES: list[dict[str, Any]] = [
    dict(num_beams=4, num_return_sequences=2),
    dict(num_beams=3, num_return_sequences=3, early_stopping=True, length_penalty=0.6),
    dict(num_beams=2, early_stopping="never", length_penalty=1.5),
]


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Iterator[Engine]:
    yield engine_on(default_model, num_blocks=256)


@pytest.fixture(scope="module")
def prompts(oracle_tokenizer: Any) -> list[list[int]]:
    return [oracle_tokenizer(p)["input_ids"] for p in PROMPTS]


@torch.no_grad()
@one_torch_thread()  # see tests/torch_threads.py
def reference(
    oracle_model: Any, prompts: list[list[int]], eos: int | None, search: dict[str, Any]
) -> list[tuple[list[list[int]], list[float]]]:
    """transformers' beams and their scores for each prompt, all prompts in one left-padded ``generate``:
    each prompt's beams are searched apart from the others', so these are the beams (and the scores within
    3e-6) of one ``generate`` per prompt, at a third of the cost (a step reads every weight, whatever the
    number of rows)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    out = oracle_model.generate(
        ids,
        attention_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        **search,
    )
    n = search.get("num_return_sequences", 1)
    beams = []
    for row, indices in zip(out.sequences, out.beam_indices, strict=True):  # n rows per prompt
        length = int((indices >= 0).sum())
        beams.append(row[width : width + length].tolist())
    scores = out.sequences_scores.tolist()
    return [(beams[i * n : (i + 1) * n], scores[i * n : (i + 1) * n]) for i in range(len(prompts))]


@pytest.mark.parametrize("with_eos", [False, True])
@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_beams_equal_transformers_on_the_default_model(
    engine: Engine, oracle_model: Any, prompts: list[list[int]], search: dict[str, Any], with_eos: bool
) -> None:
    # NOTE: the model's EOS rarely comes within a few tokens; "." (or ":" / "\n") ends hypotheses early
    eos = engine.tokenizer.encode(".", add_special_tokens=False)[-1] if with_eos else None
    res = engine.generate_batch(
        prompts,
        progress_bar=False,
        max_new_tokens=MAX_NEW,
        do_sample=False,
        eos_token_id=eos,
        ignore_eos=eos is None,
        **search,
    )
    n = search.get("num_return_sequences", 1)
    expected = reference(oracle_model, prompts, eos, search)
    for i, (beams, scores) in enumerate(expected):
        outs: list[GenerationOutput] = [
            res[f"batch_req_{i}" if j == 0 else f"batch_req_{i}/{j}"] for j in range(n)
        ]
        assert [o.generated_ids for o in outs] == beams
        assert [o.sequence_score for o in outs] == pytest.approx(scores, abs=1e-3)
