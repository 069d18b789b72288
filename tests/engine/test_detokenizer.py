"""Incremental detokenization: no broken UTF-8 in any chunk, deltas concatenate to the final decode,
special tokens honoured, bounded decode windows."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.generation.detokenizer import IncrementalDetokenizer

TEXT = "héllo 中文字符 😀 world 🎉🎉 日本語のテキスト — naïve café ✓ 한국어 🇫🇷"


class ByteTokenizer:
    """A byte-level tokenizer (as GPT-2/Llama-3 BPE): each token is some bytes, possibly a split
    UTF-8 character; decode replaces incomplete characters with U+FFFD."""

    def __init__(self, special: dict[int, bytes] | None = None) -> None:
        self.vocab: dict[int, bytes] = dict(special or {})
        self.special = set(self.vocab)
        self.calls: list[int] = []

    def encode(self, data: bytes, rng: random.Random) -> list[int]:
        ids, i = [], 0
        while i < len(data):
            n = rng.randint(1, 3)
            ids.append(self._id(data[i : i + n]))
            i += n
        return ids

    def _id(self, piece: bytes) -> int:
        for k, v in self.vocab.items():
            if v == piece and k not in self.special:
                return k
        self.vocab[len(self.vocab) + 1000] = piece
        return len(self.vocab) + 999

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.calls.append(len(ids))
        parts = [self.vocab[i] for i in ids if not (skip_special_tokens and i in self.special)]
        return b"".join(parts).decode("utf-8", errors="replace")


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("seed", range(5))
def test_split_utf8_never_emits_broken_characters(seed: int) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT.encode(), random.Random(seed))
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == tok.decode(ids) == detok.text
    assert sum(1 for d in deltas if d) > 10, "text must stream, not arrive at the end"


def test_special_tokens_skipped_or_kept() -> None:
    tok = ByteTokenizer(special={1: b"<|im_end|>"})
    ids = tok.encode("ab 中".encode(), random.Random(0)) + [1] + tok.encode(" 😀x".encode(), random.Random(1))
    skipped = "".join(_stream(IncrementalDetokenizer(tok, skip_special_tokens=True), ids))
    kept = "".join(_stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids))
    assert skipped == "ab 中 😀x" == tok.decode(ids, skip_special_tokens=True)
    assert kept == "ab 中<|im_end|> 😀x" == tok.decode(ids, skip_special_tokens=False)


def test_unfinished_character_is_flushed_at_the_end() -> None:
    tok = ByteTokenizer()
    ids = [tok._id(b"ok "), tok._id("中".encode()[:2])]
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[0]) == "ok "
    assert detok.add(ids[1]) == ""  # waits for the rest of the character
    assert detok.finish() == "\ufffd"
    assert detok.text == tok.decode(ids)


def test_decode_window_is_bounded() -> None:
    tok = ByteTokenizer()
    ids = tok.encode((TEXT * 60).encode(), random.Random(3))
    assert len(ids) > 2000
    detok = IncrementalDetokenizer(tok)
    for t in ids:
        detok.add(t)
    # a window spans the tokens since the last character boundary that was emitted (a run of split
    # CJK characters here), however long the output is
    assert max(tok.calls) <= 24, "each step must decode a short window, not the whole output"
    assert sum(tok.calls) <= 10 * len(ids), "total decode work must stay linear in the output length"
    assert detok.finish() == "" and detok.text == tok.decode(ids)


def test_real_tokenizer_streams_multibyte_text(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    text = TEXT + " <|im_end|> and more 🎉 after"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the text must split characters across tokens"
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        deltas = _stream(detok, ids)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" not in "".join(_stream(IncrementalDetokenizer(tok, True), ids))
