"""The official ``openai`` client against the real server: completions and chat, streaming and not, n > 1,
logprobs, stop, seed, usage. Greedy outputs are checked against the engine's own output for the same
prompt (submitted directly to the manager), so the test checks the server's plumbing exactly."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from server_fixtures import LiveServer

PROMPT = "The capital of France is"
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{live_server.base_url}/v1", api_key=live_server.api_key, max_retries=0, timeout=120
    )


def engine_greedy(server: LiveServer, prompt_ids: list[int], max_new_tokens: int) -> Any:
    """The engine's own greedy output for ``prompt_ids``, bypassing HTTP."""
    manager = server.state.manager
    assert manager is not None
    config = server.state.engine.generation_defaults.merged(max_new_tokens=max_new_tokens, temperature=0.0)
    rid = manager.add_request(prompt_ids, generation_config=config)
    finals = [out for out in manager.request_id_iter(rid, timeout=120) if out.is_finished]
    assert len(finals) == 1
    return finals[0]


def test_completion_greedy_matches_engine_and_usage(live_server: LiveServer, client: openai.OpenAI) -> None:
    resp = client.completions.create(model=live_server.model, prompt=PROMPT, max_tokens=8, temperature=0)
    ids = live_server.state.tokenizer.encode(PROMPT, add_special_tokens=True)
    expected = engine_greedy(live_server, ids, 8)
    assert resp.object == "text_completion"
    assert resp.id.startswith("cmpl-")
    assert resp.model == live_server.model
    assert len(resp.choices) == 1
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == ("length" if len(expected.generated_ids) == 8 else "stop")
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(expected.generated_ids)
    assert resp.usage.total_tokens == len(ids) + len(expected.generated_ids)


def test_completion_stream_concatenates_to_the_same_text(
    live_server: LiveServer, client: openai.OpenAI
) -> None:
    full = client.completions.create(model=live_server.model, prompt=PROMPT, max_tokens=8, temperature=0)
    stream = client.completions.create(
        model=live_server.model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: list[str] = []
    reasons: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts.append(c.text)
            if c.finish_reason is not None:
                reasons.append(c.finish_reason)
    assert "".join(texts) == full.choices[0].text
    assert reasons == [full.choices[0].finish_reason]
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_greedy_n2_stream_and_usage(live_server: LiveServer, client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=live_server.model, messages=CHAT, max_tokens=10, temperature=0, n=2
    )
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert [c.index for c in resp.choices] == [0, 1]
    # Greedy: both samples are the same text; the engine agrees.
    ids = live_server.state.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    expected = engine_greedy(live_server, list(ids), 10)
    for c in resp.choices:
        assert c.message.role == "assistant"
        assert c.message.content == expected.text
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(ids)  # counted once, not once per sample
    assert resp.usage.completion_tokens == 2 * len(expected.generated_ids)

    stream = client.chat.completions.create(
        model=live_server.model, messages=CHAT, max_tokens=10, temperature=0, stream=True
    )
    roles: list[str] = []
    content: list[str] = []
    reasons: list[str] = []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for sc in chunk.choices:
            if sc.delta.role:
                roles.append(sc.delta.role)
            if sc.delta.content:
                content.append(sc.delta.content)
            if sc.finish_reason:
                reasons.append(sc.finish_reason)
    assert roles == ["assistant"]
    assert "".join(content) == expected.text
    assert len(reasons) == 1


def test_completion_logprobs_shape(live_server: LiveServer, client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=live_server.model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and resp.usage is not None
    n = resp.usage.completion_tokens
    assert lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == resp.choices[0].text  # ASCII text: token strings tile it
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob is not None and logprob <= 0.0
        assert 2 <= len(top) <= 3 and token in top
        # greedy: the chosen token is the most likely one
        assert logprob == pytest.approx(max(top.values()))


def test_completion_echo_with_logprobs(live_server: LiveServer, client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=live_server.model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    text = resp.choices[0].text
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and resp.usage is not None
    num_prompt = resp.usage.prompt_tokens
    assert len(lp.token_logprobs) == num_prompt + resp.usage.completion_tokens
    # NOTE: the first prompt token has nothing before it (null, as OpenAI returns it); the others are scored.
    assert lp.token_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])


def test_chat_logprobs_shape(live_server: LiveServer, client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=live_server.model,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = resp.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None and resp.usage is not None
    entries = choice.logprobs.content
    assert len(entries) == resp.usage.completion_tokens
    assert "".join(e.token for e in entries) == choice.message.content
    for e in entries:
        assert e.logprob <= 0.0
        assert e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy picks the top one


def test_stop_string_cuts_text(live_server: LiveServer, client: openai.OpenAI) -> None:
    full = client.completions.create(model=live_server.model, prompt=PROMPT, max_tokens=8, temperature=0)
    text = full.choices[0].text
    assert len(text) >= 4
    stop = text[2:4]  # a string the greedy continuation is known to contain
    resp = client.completions.create(
        model=live_server.model, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop]
    )
    assert resp.choices[0].text == text[: text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_same_seed_same_sample(live_server: LiveServer, client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(
            model=live_server.model, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=seed
        )
        return r.choices[0].text

    assert sample(1234) == sample(1234)


def test_multi_prompt_n2_indexes_and_usage(live_server: LiveServer, client: openai.OpenAI) -> None:
    prompts = ["Hello", "One two three"]
    resp = client.completions.create(
        model=live_server.model, prompt=prompts, max_tokens=4, temperature=0, n=2
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in resp.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy samples agree per prompt
    tok = live_server.state.tokenizer
    assert resp.usage is not None
    expected_prompt_tokens: int = sum(len(tok.encode(p, add_special_tokens=True)) for p in prompts)
    assert resp.usage.prompt_tokens == expected_prompt_tokens
    assert live_server.wait_idle()


def test_models_list_and_retrieve(live_server: LiveServer, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [live_server.model]
    assert client.models.retrieve(live_server.model).id == live_server.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
