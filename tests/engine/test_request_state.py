"""RequestGenerationState: token by token, the stream equals the final text; stop strings, stop tokens,
lengths and held-back text."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.generation.config import GenerationConfig
from engine.generation.request_state import RequestGenerationState, TokenResult
from engine.outputs import TokenLogprob
from scheduler.request import FinishReason

EOS = 2  # SmolLM2's <|im_end|>


class ByteTokenizer:
    """Byte-level: token ``i`` is ``pieces[i]``; incomplete UTF-8 decodes to U+FFFD (as GPT-2 BPE)."""

    def __init__(self, pieces: list[bytes], special: frozenset[int] = frozenset()) -> None:
        self.pieces = pieces
        self.special = special

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        data = b"".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in self.special))
        return data.decode("utf-8", errors="replace")


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False) if b > a]


def _run(state: RequestGenerationState, ids: list[int], now: float = 0.0) -> tuple[list[TokenResult], str]:
    results = []
    for t in ids:
        results.append(state.on_token(t, None, now))
        streamed = "".join(r.delta_text for r in results)
        assert results[-1].text == streamed, "text must be the concatenation of the deltas"
        if results[-1].finish_reason is not None:
            break
    return results, "".join(r.delta_text for r in results)


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer


def _state(tok: Any, **cfg: Any) -> RequestGenerationState:
    cfg.setdefault("max_new_tokens", 200)
    return RequestGenerationState(
        GenerationConfig(**cfg), [1, 2, 3], tok, eos_token_ids=(EOS,), start_time=0.0
    )


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def test_stop_string_across_tokens_is_cut_and_stream_equals_text(tok: Any) -> None:
    ids = _ids(tok, "Hello there, my friend. STOP here please")
    state = _state(tok, stop_strings=["STOP"])
    results, streamed = _run(state, ids)
    assert results[-1].finish_reason is FinishReason.STOP
    assert streamed == results[-1].text == state.text == "Hello there, my friend. "
    assert len(results) < len(ids), "stops at the token completing the stop string"
    assert state.stop_string_matched == "STOP"


def test_stop_string_inside_a_token(tok: Any) -> None:
    ids = _ids(tok, "The quick brown fox jumps")
    state = _state(tok, stop_strings=["row"])  # ends inside the token " brown"
    results, streamed = _run(state, ids)
    assert results[-1].finish_reason is FinishReason.STOP
    assert streamed == "The quick b"


def test_partial_match_is_held_back_then_released(tok: Any) -> None:
    ids = _ids(tok, "It is the END of the ENDgame")
    state = _state(tok, stop_strings=["ENDING"], max_new_tokens=len(ids))
    results, streamed = _run(state, ids)
    held = [r for r in results if r.text.endswith(" the ") and r.finish_reason is None]
    assert held, "the 'END' prefix of 'ENDING' must be held back while it may still grow"
    assert results[-1].finish_reason is FinishReason.LENGTH
    assert streamed == "It is the END of the ENDgame"


def test_eos_ends_and_its_text_is_not_output(tok: Any) -> None:
    ids = _ids(tok, "Sure thing") + [EOS] + _ids(tok, " more")
    for skip in (True, False):
        state = _state(tok, skip_special_tokens=skip)
        results, streamed = _run(state, ids)
        assert results[-1].finish_reason is FinishReason.STOP
        assert streamed == "Sure thing"
        assert state.output_ids[-1] == EOS


def test_stop_token_ids_and_ignore_eos(tok: Any) -> None:
    stop = _ids(tok, " world")[0]
    state = _state(tok, stop_token_ids=[stop], ignore_eos=True, skip_special_tokens=False)
    results, streamed = _run(state, _ids(tok, "hi") + [EOS] + _ids(tok, " world again"))
    assert results[-1].finish_reason is FinishReason.STOP
    assert streamed == "hi<|im_end|>"


def test_min_new_tokens_delays_eos_and_stop_strings(tok: Any) -> None:
    ids = _ids(tok, "ab STOP") + [EOS] + _ids(tok, " cd STOP ef")
    n_before_eos = ids.index(EOS)
    state = _state(tok, stop_strings=["STOP"], min_new_tokens=n_before_eos + 1)
    results, streamed = _run(state, ids)
    assert results[-1].finish_reason is FinishReason.STOP
    # the early STOP and the EOS came before min_new_tokens: the later STOP ends it
    assert streamed == "ab STOP cd "


def test_length_flushes_held_and_undecoded_text() -> None:
    data = "ok sto😀".encode()
    pieces = [data[:3], data[3:6], data[6:8], data[8:]]  # ..."sto", half an emoji, its other half
    tok = ByteTokenizer(pieces)
    state = RequestGenerationState(GenerationConfig(stop_strings="stop", max_new_tokens=3), [0], tok, (99,))
    r1, r2, r3 = (state.on_token(i, None, 0.0) for i in range(3))
    assert (r1.delta_text, r2.delta_text) == ("ok ", "")  # "sto" may become "stop"
    assert r3.finish_reason is FinishReason.LENGTH
    assert r3.delta_text == "sto\ufffd" and r3.text == tok.decode([0, 1, 2])


def test_max_time_and_external_finish(tok: Any) -> None:
    state = _state(tok, max_time=1.0, stop_strings=["xyz"])
    ids = _ids(tok, "one two x")
    assert state.on_token(ids[0], None, 0.5).finish_reason is None
    assert state.on_token(ids[1], None, 1.5).finish_reason is FinishReason.LENGTH
    with pytest.raises(RuntimeError):
        state.on_token(ids[2], None, 1.6)
    other = _state(tok, stop_strings=["xyz"])
    for t in ids:
        other.on_token(t, None, 0.0)
    assert other.text == "one two "  # " x" may start "xyz"
    end = other.finish(FinishReason.ABORT)
    assert end.delta_text == "x" and end.text == "one two x" and end.finish_reason is FinishReason.ABORT
    assert other.finish(FinishReason.LENGTH).finish_reason is FinishReason.ABORT


def test_multibyte_stream_with_stop_string(tok: Any) -> None:
    text = "你好，世界！😀 这是一个测试。我们停止 🎉 after"
    ids = _ids(tok, text)
    state = _state(tok, stop_strings=["停止"])
    results, streamed = _run(state, ids)
    assert all("\ufffd" not in r.delta_text for r in results)
    assert results[-1].finish_reason is FinishReason.STOP
    assert streamed == "你好，世界！😀 这是一个测试。我们"


def test_rng_sampling_row_and_logprobs(tok: Any) -> None:
    cfg = GenerationConfig(seed=11, do_sample=True, output_logprobs=True)
    a = RequestGenerationState(cfg, [5], tok, (EOS,), sample_index=0)
    b = RequestGenerationState(cfg, [5], tok, (EOS,), sample_index=0)
    c = RequestGenerationState(cfg, [5], tok, (EOS,), sample_index=1)
    assert a.rng.uniform(0) == b.rng.uniform(0) != c.rng.uniform(0)
    a.on_token(42, TokenLogprob(42, -0.5), 0.0)
    row = a.sampling_row()
    assert row.output_ids == [42] and row.rng is a.rng and row.eos_token_ids == (EOS,)
    assert a.logprobs == [TokenLogprob(42, -0.5)]
    unseeded = [RequestGenerationState(GenerationConfig(), [5], tok).rng.seed for _ in range(3)]
    assert len(set(unseeded)) == 3


ALPHABET = ["a", "b", "s", "t", "o", "p", " ", "中", "😀", "é"]


@settings(max_examples=150, deadline=None)
@given(
    chars=st.lists(st.sampled_from(ALPHABET), min_size=0, max_size=40),
    cuts=st.lists(st.integers(0, 200), max_size=40),
    stops=st.lists(st.sampled_from(["stop", "中😀", "bb", "é a", "to"]), min_size=1, max_size=3),
)
def test_stream_always_equals_final_text(chars: list[str], cuts: list[int], stops: list[str]) -> None:
    """Any text, split into byte tokens anywhere, any stop strings: the stream is the final text, the
    final text ends where a stop string starts, holds none, and nothing after it leaks."""
    full = "".join(chars)
    pieces = _split(full.encode(), cuts)
    tok = ByteTokenizer(pieces)
    cfg = GenerationConfig(stop_strings=stops, max_new_tokens=max(len(pieces), 1))
    state = RequestGenerationState(cfg, [0], tok, (len(pieces) + 5,))
    results, streamed = _run(state, list(range(len(pieces))))
    if not pieces:
        return
    final = results[-1]
    assert final.finish_reason is not None
    assert streamed == final.text
    if any(s in full for s in stops):
        # cut where a stop string starts (which one depends on where the tokens end: stops "to" and
        # "stop" over "sto|p" cut at "to"; over "stop" in one token, at "stop")
        assert final.finish_reason is FinishReason.STOP
        assert state.stop_string_matched is not None
        assert full.startswith(final.text + state.stop_string_matched)
    else:
        assert final.finish_reason is FinishReason.LENGTH
        assert final.text == full
    assert not any(s in final.text for s in stops)
