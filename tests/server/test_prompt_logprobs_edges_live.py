"""Prompt log-probabilities over HTTP at the edges: ``max_tokens: 0`` without ``echo`` is a 400 naming it, and
``prompt_logprobs`` keeps its own number of alternatives beside ``echo`` with a larger ``logprobs``."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import torch
from server_fixtures import LiveServer

PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"
ATOL = 2e-3


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key=live_server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def reference(oracle_model: Any, oracle_tokenizer: Any) -> tuple[list[int], torch.Tensor]:
    ids = oracle_tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = oracle_model(torch.tensor([ids])).logits[0, :-1].float()
    return ids, torch.log_softmax(logits, dim=-1)


def test_max_tokens_0_without_echo_is_400_naming_it(live_server: LiveServer) -> None:
    body = {"model": live_server.model, "prompt": PROMPT, "max_tokens": 0}
    resp = httpx.post(
        f"{live_server.base_url}/v1/completions", json=body, headers=live_server.headers, timeout=60
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_keeps_its_own_k_beside_echo_logprobs(live_server: LiveServer) -> None:
    """``prompt_logprobs: 1`` with ``echo`` and ``logprobs: 4``: the engine scores the prompt with the larger
    k (4), and each view shows its own: vLLM's ``prompt_logprobs`` one alternative (+ the token), the echo's
    ``top_logprobs`` four (+ the token). Main gives ``prompt_logprobs`` all four."""
    body = {
        "model": live_server.model,
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "echo": True,
        "logprobs": 4,
        "prompt_logprobs": 1,
    }
    resp = httpx.post(
        f"{live_server.base_url}/v1/completions", json=body, headers=live_server.headers, timeout=60
    )
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert all(len(entry) <= 2 for entry in choice["prompt_logprobs"][1:]), choice["prompt_logprobs"][1]
    assert all(4 <= len(top) <= 5 for top in choice["logprobs"]["top_logprobs"][1:-1])
