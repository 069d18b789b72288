"""OpenAI's strictness (typed fields, stream_options only with a stream), the engine's processors under
vLLM's names, the fields cbserve refuses, and chat_template_kwargs: request models and tables without a
model; a few through HTTP on the live server (slow)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from server_fixtures import LiveServer

from engine.generation.config import GenerationConfig
from engine.loader.chat_template import ChatTemplateError, render_chat_template
from server.errors import APIError
from server.generation_params import bad_words_ids, build_generation_config
from server.schemas import ChatCompletionRequest, CompletionRequest
from server.unsupported_fields import UNSUPPORTED_FIELDS, check_unsupported_fields

MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def refused_field(make: Any, **fields: Any) -> str:
    with pytest.raises(ValidationError) as exc:
        make(**fields)
    return str(exc.value.errors()[0]["loc"][0])


@pytest.mark.parametrize(
    ("make", "fields", "param"),
    [
        (completion, {"stream": "true"}, "stream"),
        (completion, {"stream": 1}, "stream"),
        (completion, {"echo": "false"}, "echo"),
        (completion, {"n": "2"}, "n"),
        (completion, {"max_tokens": "8"}, "max_tokens"),
        (completion, {"max_tokens": 8.5}, "max_tokens"),
        (completion, {"temperature": "0.5"}, "temperature"),
        (completion, {"top_p": True}, "top_p"),
        (completion, {"seed": "7"}, "seed"),
        (completion, {"logprobs": True}, "logprobs"),
        (completion, {"logit_bias": {"5": "1"}}, "logit_bias"),
        (chat, {"logprobs": "true"}, "logprobs"),
        (chat, {"top_logprobs": "2", "logprobs": True}, "top_logprobs"),
        (chat, {"add_generation_prompt": "yes"}, "add_generation_prompt"),
        (chat, {"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options"),
    ],
)
def test_a_string_for_a_boolean_or_number_is_refused(make: Any, fields: dict[str, Any], param: str) -> None:
    assert refused_field(make, **fields) == param


def test_ints_for_numbers_stay_valid() -> None:
    req = completion(temperature=1, top_p=1, presence_penalty=0, logit_bias={"5": 2})
    assert req.temperature == 1.0 and isinstance(req.temperature, float)
    assert req.logit_bias == {"5": 2.0}


def test_stream_options_need_a_stream() -> None:
    assert refused_field(completion, stream_options={"include_usage": True}) == "stream_options"
    assert refused_field(chat, stream=False, stream_options={}) == "stream_options"
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage


def test_omitted_temperature_samples_at_the_model_default_else_one() -> None:
    plain = build_generation_config(chat(), GenerationConfig(), 8, False, 0)
    assert plain.do_sample is True and plain.temperature == 1.0 and not plain.is_greedy
    # NOTE: a file that sets a temperature but not do_sample still samples at it (vLLM's reading).
    model = build_generation_config(chat(), GenerationConfig(temperature=0.6), 8, False, 0)
    assert model.do_sample is True and model.temperature == 0.6
    assert build_generation_config(chat(temperature=0), GenerationConfig(), 8, False, 0).is_greedy


def test_every_processor_under_its_vllm_name() -> None:
    config = build_generation_config(
        completion(typical_p=0.9, epsilon_cutoff=3e-4, eta_cutoff=1e-3, no_repeat_ngram_size=3),
        GenerationConfig(),
        8,
        False,
        0,
        bad_words=[[5, 6], [7]],
    )
    assert (config.typical_p, config.epsilon_cutoff, config.eta_cutoff) == (0.9, 3e-4, 1e-3)
    assert config.no_repeat_ngram_size == 3 and config.bad_words_ids == [[5, 6], [7]]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"typical_p": 0}, "typical_p"),
        ({"typical_p": 1.5}, "typical_p"),
        ({"epsilon_cutoff": 1}, "epsilon_cutoff"),
        ({"eta_cutoff": -0.1}, "eta_cutoff"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"bad_words": "word"}, "bad_words"),
    ],
)
def test_out_of_range_processors_name_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused_field(completion, **fields) == param


class _WordTokenizer:
    """One id per word, 100 more after a space (as BPE spells "Ġword" apart from "word")."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        words = text.split()
        return [len(w) + (100 if i > 0 or text.startswith(" ") else 0) for i, w in enumerate(words)]


def test_bad_words_become_ids_with_and_without_a_leading_space() -> None:
    assert bad_words_ids(["abc", " abc", "de fg"], _WordTokenizer()) == [[3], [103], [2, 102], [102, 102]]
    assert bad_words_ids(["   "], _WordTokenizer()) is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"echo": True}, "echo"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
    ],
)
def test_fields_cbserve_cannot_honour_are_a_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as exc:
        check_unsupported_fields(chat(**fields))
    assert exc.value.status == 400 and exc.value.param == param and "not supported" in exc.value.message


def test_neutral_values_of_those_fields_are_accepted() -> None:
    check_unsupported_fields(
        chat(n=2, modalities=["text"], allowed_token_ids=None, include_stop_str_in_output=False)
    )
    assert len({f.name for f in UNSUPPORTED_FIELDS}) == len(UNSUPPORTED_FIELDS)


def test_chat_template_kwargs_reach_the_template_but_not_the_reserved_names() -> None:
    template = "{{ messages[0]['content'] }}{% if enable_thinking is false %} /no_think{% endif %}"
    assert render_chat_template(template, MESSAGES, enable_thinking=False) == "hi /no_think"
    assert render_chat_template(template, MESSAGES) == "hi"
    assert chat(chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs == {
        "enable_thinking": False
    }
    assert refused_field(chat, chat_template_kwargs={"messages": []}) == "chat_template_kwargs"
    with pytest.raises(ChatTemplateError):
        render_chat_template(template, MESSAGES, raise_exception="shadowed")


# ----------------------------------------------------------------------------------- through HTTP (slow)
CHAT = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize(
    ("override", "param"),
    [
        ({"stream": "true"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"temperature": "0"}, "temperature"),
        ({"typical_p": 0}, "typical_p"),
        ({"best_of": 4}, "best_of"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ],
)
def test_http_400_names_the_field(http: httpx.Client, override: dict[str, Any], param: str) -> None:
    resp = http.post("/v1/chat/completions", json={**CHAT, **override})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_http_processors_apply(http: httpx.Client, live_server: LiveServer) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    # NOTE: banning the greedy output's first word changes the greedy output from there on.
    banned = http.post("/v1/completions", json={**body, "bad_words": [plain.split()[0]]})
    assert banned.status_code == 200, banned.text
    assert banned.json()["choices"][0]["text"] != plain
    extras = {"typical_p": 0.9, "epsilon_cutoff": 1e-4, "eta_cutoff": 1e-4, "no_repeat_ngram_size": 2}
    sampled = http.post("/v1/completions", json={**body, **extras, "temperature": 0.8, "seed": 1})
    assert sampled.status_code == 200, sampled.text
    assert live_server.wait_idle()
