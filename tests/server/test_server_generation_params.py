"""OpenAI request fields -> GenerationConfig, and the max_tokens default (no model needed)."""

from __future__ import annotations

import pytest

from engine.errors import ContextLengthExceededError
from engine.generation.config import GenerationConfig, GenerationConfigError
from server.errors import APIError, api_error_from_engine
from server.generation_params import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    build_generation_config,
    resolve_max_tokens,
)
from server.schemas import ChatCompletionRequest, CompletionRequest

DEFAULTS = GenerationConfig(top_k=50, temperature=0.7, do_sample=True)
MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def build(req: CompletionRequest | ChatCompletionRequest, logprobs: bool = False, top: int = 0) -> GenerationConfig:
    return build_generation_config(req, DEFAULTS, 8, logprobs, top)


def test_unset_fields_keep_the_model_defaults() -> None:
    config = build(completion())
    assert (config.do_sample, config.temperature, config.top_k) == (True, 0.7, 50)
    assert config.max_new_tokens == 8 and config.num_return_sequences == 1


def test_temperature_zero_is_greedy_and_positive_samples() -> None:
    greedy = build(completion(temperature=0))
    assert greedy.do_sample is False and greedy.is_greedy
    hot = build_generation_config(completion(temperature=1.3), GenerationConfig(), 8, False, 0)
    assert hot.do_sample is True and hot.temperature == 1.3


def test_fields_map_to_options() -> None:
    config = build(
        completion(
            n=3,
            top_p=0.9,
            top_k=-1,
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            logit_bias={"42": -100, "7": 5},
            stop="END",
            stop_token_ids=[3, 4],
            seed=11,
            ignore_eos=True,
            min_tokens=2,
            skip_special_tokens=False,
        ),
        logprobs=True,
        top=4,
    )
    assert config.num_return_sequences == 3 and config.top_p == 0.9 and config.top_k == 0
    assert config.min_p == 0.05 and config.presence_penalty == 0.5 and config.frequency_penalty == -0.5
    assert config.repetition_penalty == 1.1 and config.logit_bias == {42: -100.0, 7: 5.0}
    assert config.stop_strings == ["END"] and config.stop_token_ids == [3, 4] and config.seed == 11
    assert config.ignore_eos is True and config.min_new_tokens == 2 and config.skip_special_tokens is False
    assert config.output_logprobs is True and config.top_logprobs == 4


def test_bad_logit_bias_key_is_a_400() -> None:
    with pytest.raises(APIError) as exc:
        build(completion(logit_bias={"tok": 1}))
    assert exc.value.status == 400 and exc.value.param == "logit_bias"


def test_config_errors_name_the_request_field() -> None:
    with pytest.raises(GenerationConfigError) as exc:
        build(completion(min_tokens=20))  # more than max_new_tokens=8
    error = api_error_from_engine(exc.value)
    assert error is not None and error.status == 400 and error.param == "min_tokens"


def test_max_tokens_defaults() -> None:
    assert resolve_max_tokens(completion(), 10, 512, 4096, DEFAULTS) == DEFAULT_COMPLETION_MAX_TOKENS
    assert resolve_max_tokens(chat(), 10, 8192, 100_000, DEFAULTS) == DEFAULT_CHAT_MAX_TOKENS
    assert resolve_max_tokens(chat(), 10, 512, 4096, DEFAULTS) == 502  # the room left in the context
    assert resolve_max_tokens(chat(), 10, 8192, 300, DEFAULTS) == 290  # the room left in the KV cache
    assert resolve_max_tokens(chat(), 10, 8192, 4096, GenerationConfig(max_new_tokens=64)) == 64
    assert resolve_max_tokens(chat(max_tokens=5, max_completion_tokens=7), 10, 512, 4096, DEFAULTS) == 7


def test_context_length_exceeded() -> None:
    with pytest.raises(ContextLengthExceededError) as exc:
        resolve_max_tokens(completion(max_tokens=100), 450, 512, 4096, DEFAULTS)
    error = api_error_from_engine(exc.value, "prompt")
    assert error is not None and error.code == "context_length_exceeded" and "512" in error.message
    with pytest.raises(ContextLengthExceededError):
        resolve_max_tokens(chat(), 512, 512, 4096, DEFAULTS)  # a full window leaves no room, default or not
