"""DoLa (engine/executor/dola.py): the contrast equals transformers 4.x's definition on scripted logits, the
candidate layers are transformers' choice, and through ``generate_batch`` on the default model a DoLa
request decodes as the definition does on transformers' own model (its hidden states, its head), alone and
beside plain requests that it leaves unchanged; bad ``dola_layers`` are refused naming the field, over HTTP
too. transformers 5.x moved DoLa out of its core, so the definition is transcribed here
(``_relative_top_filter`` and ``_dola_select_contrast`` of transformers 4.x's generation/utils.py)."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from default_engine import engine_on
from torch_threads import one_torch_thread
from transformers import RepetitionPenaltyLogitsProcessor

from engine.engine import Engine
from engine.executor.dola import LayerContrast, contrast
from engine.generation.config import GenerationConfig
from engine.generation.errors import GenerationConfigError
from engine.loader.model_loader import LoadedModel


# ---------------------------------------------------------------- transformers 4.x, transcribed
def _relative_top_filter(
    scores: torch.Tensor, baseline_scores: torch.Tensor, relative_top: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    scores_normalized = scores.log_softmax(dim=-1)
    baseline_scores_normalized = baseline_scores.log_softmax(dim=-1)
    sorted_logits, _ = torch.sort(scores_normalized, descending=True)
    min_thresh = sorted_logits[..., 0]
    probs_max = torch.max(scores_normalized, dim=-1).values
    probs_thresh = torch.min(min_thresh, probs_max + np.log(relative_top)).unsqueeze(-1)
    baseline_scores_normalized[scores_normalized < probs_thresh] = -1e-3
    scores_normalized[scores_normalized < probs_thresh] = -float("Inf")
    return scores_normalized, baseline_scores_normalized


def _dola_select_contrast(
    layers: list[int], premature: dict[int, torch.Tensor], final: torch.Tensor
) -> torch.Tensor:
    if len(layers) == 1:
        final, base = _relative_top_filter(final, premature[layers[0]])
        return final - base
    stacked = torch.stack([premature[i] for i in layers], dim=0)
    softmax_mature = F.softmax(final, dim=-1)
    softmax_premature = F.softmax(stacked, dim=-1)
    avg = 0.5 * (softmax_mature[None, :, :] + softmax_premature)
    kl1 = F.kl_div(F.log_softmax(final, dim=-1)[None, :, :], avg, reduction="none").mean(-1)
    kl2 = F.kl_div(F.log_softmax(stacked, dim=-1), avg, reduction="none").mean(-1)
    js = (0.5 * (kl1 + kl2)).mean(-1)
    final, base = _relative_top_filter(final, premature[layers[int(js.argmax().item())]])
    return final - base


# ---------------------------------------------------------------- the contrast and the layers
@pytest.mark.parametrize("num_layers", [1, 3, 8])
def test_contrast_is_the_definition_on_scripted_logits(num_layers: int) -> None:
    gen = torch.Generator().manual_seed(num_layers)
    for _ in range(5):
        final = torch.randn(1, 500, generator=gen) * 3
        premature = {layer: torch.randn(1, 500, generator=gen) * 3 for layer in range(num_layers)}
        expected = _dola_select_contrast(list(premature), premature, final.clone())
        ours = contrast(final[0], torch.cat(list(premature.values())))
        assert torch.equal(ours, expected[0])
        assert torch.isinf(ours).any() and torch.isfinite(ours).any()  # tokens far below the best are out


def test_candidate_layers_are_transformers_choice() -> None:
    tied, untied = LayerContrast(30, True), LayerContrast(30, False)
    assert tied.candidate_layers("low") == tuple(range(2, 15, 2))
    assert untied.candidate_layers("low") == tuple(range(0, 15, 2))
    assert tied.candidate_layers("high") == tuple(range(15, 30, 2))
    assert LayerContrast(50, True).candidate_layers("low") == tuple(range(2, 20, 2))
    assert LayerContrast(50, True).candidate_layers("high") == tuple(range(30, 50, 2))
    assert LayerContrast(2, True).candidate_layers("low") == (1,)
    assert tied.candidate_layers([3, 40, 7]) == (3, 7)
    with pytest.raises(ValueError, match="no layer"):
        tied.candidate_layers([30, 31])


@pytest.mark.parametrize("value", ["middle", [], [1, -2], [True], 3])
def test_bad_dola_layers_name_the_field(value: Any) -> None:
    with pytest.raises(GenerationConfigError, match="dola_layers"):
        GenerationConfig(dola_layers=value)


# ---------------------------------------------------------------- end to end on the default model
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Water boils at",
]  # the first is DoLa beside the others
NEW_TOKENS = 12
NEAR_TIE = 1e-3


@one_torch_thread()  # see tests/torch_threads.py
def _reference(oracle_model: Any, prompt: list[int], layers: list[int]) -> tuple[list[int], list[float]]:
    """Greedy DoLa by the definition on transformers' model: each step's hidden states and head, the
    contrast, then the repetition penalty as transformers' logits_processor applies it."""
    ids = torch.tensor([prompt])
    penalty = RepetitionPenaltyLogitsProcessor(1.2)
    tokens, margins = [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            out = oracle_model(ids, output_hidden_states=True)
            final = out.logits[:, -1, :].float()
            premature = {i: oracle_model.lm_head(out.hidden_states[i][:, -1, :]).float() for i in layers}
            scores = penalty(ids, _dola_select_contrast(layers, premature, final))
            top2 = scores[0].topk(2).values
            margins.append(float(top2[0] - top2[1]))
            token = int(scores[0].argmax())
            tokens.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, margins


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Engine:
    return engine_on(default_model)


@pytest.mark.slow
@pytest.mark.parametrize("dola_layers", ["high", [4, 12, 20]])
def test_greedy_dola_is_the_definition_on_transformers_model(
    engine: Engine, oracle_model: Any, dola_layers: str | list[int]
) -> None:
    layers = list(LayerContrast(30, True).candidate_layers(dola_layers))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    plain_alone = engine.generate_batch(
        prompts[1:], progress_bar=False, max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=1.2
    )
    dola = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=1.2, dola_layers=dola_layers
    )
    manager = engine.init_continuous_batching()
    manager.start()
    try:  # one DoLa request beside two plain ones, then the DoLa ones alone
        ids = [manager.add_request(prompts[0], generation_config=dola)]
        ids += [
            manager.add_request(p, max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=1.2)
            for p in prompts[1:]
        ]
        mixed = {o.request_id: o for o in (manager.get_result(timeout=120) for _ in ids) if o is not None}
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
    for i, rid in enumerate(ids[1:]):  # the plain rows are as they are alone
        assert mixed[rid].generated_ids == plain_alone[f"batch_req_{i}"].generated_ids
    alone = engine.generate_batch(prompts, generation_config=dola, progress_bar=False)
    assert mixed[ids[0]].generated_ids == alone["batch_req_0"].generated_ids
    compared = 0
    for i, prompt in enumerate(prompts):
        expected, margins = _reference(oracle_model, prompt, layers)
        ours = alone[f"batch_req_{i}"].generated_ids
        for step, token in enumerate(expected):
            assert ours[step] == token, (PROMPTS[i], ours, expected)
            compared += 1
            if margins[step] < NEAR_TIE:  # float rounding may pick either: later tokens are not comparable
                break
    assert compared >= len(prompts) * NEW_TOKENS // 2


@pytest.mark.slow
def test_dola_is_refused_where_the_layers_are_not_there(engine: Engine) -> None:
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        with pytest.raises(GenerationConfigError, match="dola_layers"):
            manager.add_request([1, 2, 3], max_new_tokens=2, dola_layers=[30, 40])
    finally:
        manager.stop(timeout=30)


def test_dola_layers_over_http(http: httpx.Client) -> None:
    ok = http.post(
        "/v1/completions",
        json={
            "prompt": "The capital of France is",
            "max_tokens": 6,
            "temperature": 0,
            "dola_layers": "high",
            "repetition_penalty": 1.2,
        },
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["text"]
    for bad in ("middle", [99]):
        resp = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "dola_layers": bad})
        assert resp.status_code == 400, resp.text
        assert "dola_layers" in (resp.json()["error"]["param"] or "")
