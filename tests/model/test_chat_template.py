"""Chat templates render in a sandbox exactly as transformers' ``apply_chat_template`` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.loader.chat_template import ChatTemplateError, NoChatTemplateError, render_chat_template
from engine.loader.tokenizer import Tokenizer

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
    [
        {"role": "system", "content": "Réponds en français 🇫🇷."},
        {"role": "user", "content": "日本語で?\n\nline two\twith tab"},
        {"role": "assistant", "content": "  spaced  "},
        {"role": "user", "content": "<html> & 'quotes' \"double\""},
    ],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def ours(smollm2_reader: Any, smollm2_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_reader, str(smollm2_gguf_path))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=[f"conv{i}" for i in range(len(CONVERSATIONS))])
def test_smollm2_prompt_matches_transformers(
    ours: Tokenizer, oracle_tokenizer: Any, conversation: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected_text = oracle_tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == expected_text
    expected_ids = oracle_tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == list(expected_ids)


def test_default_system_prompt_and_generation_prompt(ours: Tokenizer) -> None:
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tojson_does_not_html_escape_and_trim_blocks() -> None:
    template = "{% for m in messages %}\n  {{ m | tojson }}\n{% endfor %}"
    out = render_chat_template(template, [{"role": "user", "content": "<a & 'b'>"}])
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one
    assert out == '  {"role": "user", "content": "<a & \'b\'>"}\n'


def test_bos_eos_and_extra_variables_reach_the_template() -> None:
    template = "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{% if flag %}!{% endif %}"
    assert render_chat_template(template, [{"role": "user", "content": "x"}], bos_token="<s>", eos_token="</s>",
                                flag=True) == "<s>x</s>!"


def test_loop_controls_are_enabled() -> None:
    template = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    assert render_chat_template(template, [{"role": "a"}, {"role": "b"}]) == "a"


def test_raise_exception_becomes_chat_template_error() -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    assert render_chat_template(template, [{"role": "user", "content": ""}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        render_chat_template(template, [{"role": "assistant", "content": ""}])


def test_sandbox_blocks_mutation_and_dunder_access() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.append(1) }}", [{"role": "user"}])
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", [{"role": "user"}])


def test_bad_template_and_bad_messages_are_clear_errors() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [{"role": "user"}])
    with pytest.raises(ChatTemplateError, match="message 0"):
        render_chat_template("x", ["not a dict"])  # type: ignore[list-item]


def test_no_template_is_a_clear_error(ours: Tokenizer) -> None:
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        render_chat_template(None, [{"role": "user", "content": "hi"}])
    bare = Tokenizer(ours.backend, eos_token="<|im_end|>", chat_template=None, name="bare-model")
    with pytest.raises(NoChatTemplateError, match="bare-model has no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
