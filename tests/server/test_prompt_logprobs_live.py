"""Prompt log-probabilities over HTTP on the default model: completions ``echo`` with ``logprobs`` (what
lm-eval's ``local-completions`` sends to score text) with the official ``openai`` client, streamed and not,
and vLLM's ``prompt_logprobs`` on both endpoints, checked against transformers on the same weights."""

from __future__ import annotations

import json
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


def test_echo_with_logprobs_scores_the_prompt(
    live_server: LiveServer, client: openai.OpenAI, reference: tuple[list[int], torch.Tensor]
) -> None:
    ids, ref = reference
    resp = client.completions.create(
        model=live_server.model, prompt=PROMPT, max_tokens=1, echo=True, logprobs=2, temperature=0
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None and lp.tokens
    assert resp.choices[0].text.startswith(PROMPT)
    assert "".join(lp.tokens[: len(ids)]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=ATOL)
        top = lp.top_logprobs[i]
        assert top is not None and lp.tokens[i] in top and 2 <= len(top) <= 3
    assert len(lp.token_logprobs) == len(ids) + 1  # the prompt, then the generated token


def test_streamed_echo_carries_the_same_logprobs(live_server: LiveServer, client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": live_server.model, "prompt": PROMPT, "max_tokens": 3, "echo": True}
    whole = client.completions.create(logprobs=1, temperature=0, **kwargs)
    chunks = list(client.completions.create(logprobs=1, temperature=0, stream=True, **kwargs))
    streamed: list[float | None] = []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.token_logprobs or [])
    assert whole.choices[0].logprobs is not None
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-6)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def _vllm_entries(entries: list[Any], ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        entry = {int(t): v for t, v in entries[i].items()}
        assert ids[i] in entry and k <= len(entry) <= k + 1
        assert entry[ids[i]]["logprob"] == pytest.approx(float(ref[i - 1, ids[i]]), abs=ATOL)
        assert {v["rank"] for t, v in entry.items() if t != ids[i]} <= set(range(1, k + 1))
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())


def test_vllm_prompt_logprobs_on_both_endpoints(
    live_server: LiveServer, reference: tuple[list[int], torch.Tensor]
) -> None:
    ids, ref = reference
    base = {"model": live_server.model, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    with httpx.Client(base_url=live_server.base_url, headers=live_server.headers, timeout=120) as http:
        completion = http.post("/v1/completions", json=base | {"prompt": PROMPT})
        assert completion.status_code == 200, completion.text
        _vllm_entries(completion.json()["choices"][0]["prompt_logprobs"], ids, ref, 2)
        chat = http.post(
            "/v1/chat/completions", json=base | {"messages": [{"role": "user", "content": "Hi"}]}
        )
        assert chat.status_code == 200, chat.text
        body = chat.json()
        assert (
            body["prompt_logprobs"][0] is None
            and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
        )
        plain = http.post(
            "/v1/completions", json={"model": live_server.model, "prompt": PROMPT, "max_tokens": 1}
        )
        assert (
            "prompt_logprobs" not in plain.json()["choices"][0]
            or plain.json()["choices"][0]["prompt_logprobs"] is None
        )


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
     ({"prompt_logprobs": "2"}, "prompt_logprobs"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")],
)  # fmt: skip
def test_bad_prompt_logprobs_are_400_naming_the_field(
    live_server: LiveServer, extra: dict[str, Any], param: str
) -> None:
    body = {"model": live_server.model, "prompt": PROMPT, "max_tokens": 1} | extra
    resp = httpx.post(
        f"{live_server.base_url}/v1/completions", json=body, headers=live_server.headers, timeout=60
    )
    assert resp.status_code == 400, resp.text
    error = json.loads(resp.text)["error"]
    assert error["param"] == param and "prompt_logprobs" in error["message"]
