"""Token-level stopping: EOS, stop_token_ids, min_new_tokens, max_new_tokens and max_time."""

from __future__ import annotations

from engine.generation.config import DEFAULT_MAX_NEW_TOKENS, GenerationConfig
from engine.generation.stopping import StoppingCriteria
from scheduler.request import FinishReason

MODEL_EOS = (2, 7)


def test_model_eos_and_stop_token_ids_stop() -> None:
    c = StoppingCriteria(GenerationConfig(stop_token_ids=[9]), MODEL_EOS)
    assert c.is_stop_token(2, 1) and c.is_stop_token(7, 1) and c.is_stop_token(9, 1)
    assert not c.is_stop_token(3, 1)


def test_config_eos_replaces_model_eos() -> None:
    c = StoppingCriteria(GenerationConfig(eos_token_id=5), MODEL_EOS)
    assert c.is_stop_token(5, 1) and not c.is_stop_token(2, 1)
    assert c.eos_token_ids == (5,)


def test_ignore_eos_keeps_stop_token_ids() -> None:
    c = StoppingCriteria(GenerationConfig(ignore_eos=True, stop_token_ids=[9]), MODEL_EOS)
    assert not c.is_stop_token(2, 1) and c.is_stop_token(9, 1)
    assert c.eos_token_ids == ()


def test_min_new_tokens_delays_stop_tokens() -> None:
    c = StoppingCriteria(GenerationConfig(min_new_tokens=3, stop_token_ids=[9]), MODEL_EOS)
    # the 1st..3rd tokens may not stop; the 4th may (output length 4 > min_new_tokens 3)
    assert [c.is_stop_token(2, n) for n in (1, 2, 3, 4)] == [False, False, False, True]
    assert [c.is_stop_token(9, n) for n in (1, 3, 4)] == [False, False, True]
    assert not c.may_stop(3) and c.may_stop(4)


def test_length() -> None:
    c = StoppingCriteria(GenerationConfig(max_new_tokens=4), MODEL_EOS, start_time=0.0)
    assert [c.length_or_time(n, 0.0) for n in (1, 3, 4)] == [None, None, FinishReason.LENGTH]
    default = StoppingCriteria(GenerationConfig(), MODEL_EOS, start_time=0.0)
    assert default.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    engine_cap = StoppingCriteria(GenerationConfig(), MODEL_EOS, max_new_tokens=10, start_time=0.0)
    assert engine_cap.length_or_time(10, 0.0) is FinishReason.LENGTH


def test_max_time_reports_length() -> None:
    c = StoppingCriteria(GenerationConfig(max_time=1.5), MODEL_EOS, start_time=100.0)
    assert c.length_or_time(1, 101.0) is None
    assert c.length_or_time(1, 101.5) is None  # HF: strictly more than max_time
    assert c.length_or_time(1, 101.6) is FinishReason.LENGTH
