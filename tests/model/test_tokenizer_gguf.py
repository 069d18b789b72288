"""The tokenizer rebuilt from GGUF metadata encodes and decodes exactly as transformers' AutoTokenizer
loaded from the same GGUF file."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine.loader.tokenizer import Tokenizer, bytes_to_unicode

CORPUS: list[str] = [
    "Hello, world!",
    "hello world",
    " leading space",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple     spaces    inside",
    "tabs\tand\t\ttabs",
    "\t\tindented with tabs",
    "line one\nline two\n\nline four",
    "\n\n\nonly newlines first",
    "windows\r\nline endings\r\n",
    "   \n  \n\t \n",
    "",
    " ",
    "I'm sure you're right, they'll see we've done it; she'd know, it's John's.",
    "DON'T SHOUT, YOU'RE LOUD",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e10 1,000,000",
    "Phone: +1 (555) 123-4567, year 2024, version v1.2.3",
    "Ünïcödé àccénts çà et là — naïve café",
    "Straße, Ærøskøbing, Łódź, İstanbul",
    "日本語のテキストです。東京は大きい。",
    "中文测试：你好，世界！",
    "한국어 문장입니다.",
    "Русский текст и ещё немного.",
    "Ελληνικά γράμματα",
    "عربي نص قصير",
    "हिन्दी पाठ",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "mixed日本語andEnglish123混合",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    "https://example.com/path?query=1&other=two#frag",
    "$ ls -la | grep '.py' && echo \"done\" > /dev/null",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_end|><|im_end|>",
    "<repo_name>cbserve<file_sep>engine/model_config.py",
    "<|im_start|> spaced <|im_end|>",
    "almost special <|im_start and |>",
    "Symbols: ~!@#$%^&*()_+-=[]{}|;':\",./<>?`",
    "ellipsis… quotes “curly” ‘single’ «guillemets»",
    "zero\u200bwidth\u200djoiner and nbsp\u00a0here",
    "control chars \x00\x01\x7f bell",
    "a" * 300,
    "The quick brown fox jumps over the lazy dog. " * 5,
    "MiXeD CaSe WoRdS and camelCaseIdentifiers and snake_case_names",
    "math: ∑_{i=1}^{n} x_i² ≤ ∞, √2 ≈ 1.414, α+β=γ",
]


@pytest.fixture(scope="module")
def ours(smollm2_reader: Any, smollm2_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_reader, str(smollm2_gguf_path))


def test_corpus_is_large_and_varied() -> None:
    assert len(CORPUS) >= 40
    assert len(set(CORPUS)) == len(CORPUS)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours: Tokenizer, oracle_tokenizer: Any, add_special_tokens: bool) -> None:
    for text in CORPUS:
        expected = oracle_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, repr(text)
    batch = ours.encode_batch(CORPUS, add_special_tokens=add_special_tokens)
    assert batch == [oracle_tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in CORPUS]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(ours: Tokenizer, oracle_tokenizer: Any, skip_special_tokens: bool) -> None:
    for text in CORPUS:
        ids = oracle_tokenizer.encode(text, add_special_tokens=False)
        expected = oracle_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected, repr(text)


def test_roundtrip_text(ours: Tokenizer) -> None:
    # byte-level BPE is lossless: every string without special tokens decodes back to itself
    for text in CORPUS:
        if "<|" in text or "<repo_name>" in text:
            continue
        assert ours.decode(ours.encode(text)) == text, repr(text)


def test_decode_random_id_sequences_matches_transformers(ours: Tokenizer, oracle_tokenizer: Any) -> None:
    # arbitrary ids (what a sampler may produce) include broken UTF-8 sequences and special tokens
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == oracle_tokenizer.decode(
                ids, skip_special_tokens=skip
            )


def test_tokens_and_special_ids_match_transformers(ours: Tokenizer, oracle_tokenizer: Any) -> None:
    assert ours.vocab_size == len(oracle_tokenizer) == 49152
    assert ours.bos_token_id == oracle_tokenizer.bos_token_id == 1
    assert ours.eos_token_id == oracle_tokenizer.eos_token_id == 2
    assert ours.eos_token_ids == (2,)
    assert ours.pad_token_id == oracle_tokenizer.pad_token_id
    assert ours.unk_token_id == oracle_tokenizer.unk_token_id
    assert set(oracle_tokenizer.all_special_ids) <= set(ours.all_special_ids)
    # every control token of the GGUF is special (skipped when decoding)
    assert ours.all_special_ids == list(range(17))
    ids = list(range(0, 49152, 97))
    assert ours.convert_ids_to_tokens(ids) == oracle_tokenizer.convert_ids_to_tokens(ids)
    assert ours.chat_template == oracle_tokenizer.chat_template


def test_special_tokens_are_single_ids(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert ours.encode("a<|im_end|>b", add_special_tokens=False)[1] == 2
    # skipped on decode by default, kept when asked
    assert ours.decode([1, *ours.encode("hi", add_special_tokens=False), 2]) == "hi"
    assert ours.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"


def test_save_and_reload_from_tokenizer_json(ours: Tokenizer, oracle_tokenizer: Any, tmp_path: Path) -> None:
    ours.save(tmp_path)
    reloaded = Tokenizer.from_pretrained(tmp_path)
    assert reloaded.vocab_size == ours.vocab_size
    assert reloaded.eos_token_ids == ours.eos_token_ids and reloaded.bos_token_id == ours.bos_token_id
    assert reloaded.chat_template == ours.chat_template
    assert reloaded.all_special_ids == ours.all_special_ids
    for text in CORPUS:
        assert reloaded.encode(text) == ours.encode(text), repr(text)

    # transformers reads the folder we wrote as the same tokenizer
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in CORPUS[:20]:
        assert theirs.encode(text) == oracle_tokenizer.encode(text), repr(text)


def test_bytes_to_unicode_is_gpt2_alphabet() -> None:
    table = bytes_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"
