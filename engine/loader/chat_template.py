"""Chat templates: the model's Jinja template that turns a list of messages into one prompt string.

Templates come from the model's files (``tokenizer_config.json`` or GGUF ``tokenizer.chat_template``) and
are untrusted code, so they run in jinja2's ``ImmutableSandboxedEnvironment``. The environment matches
transformers' ``apply_chat_template`` (trim_blocks, lstrip_blocks, loop controls, a ``tojson`` that does
not HTML-escape, ``raise_exception``, ``strftime_now``) so a prompt renders to the same string as there.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The variables ``render_chat_template`` sets, and the functions templates call: never set by ``extra``.
_RENDERER_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})
_TEMPLATE_FUNCTIONS = frozenset(
    {"raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace"}
)
# What a request's ``chat_template_kwargs`` may not set: the above, what the server passes itself
# (``tools``; ``tokenize``) and transformers' name for the messages. Any other name (``enable_thinking``,
# ``documents``, ...) reaches the template.
RESERVED_TEMPLATE_VARIABLES = (
    _RENDERER_VARIABLES | _TEMPLATE_FUNCTIONS | {"tools", "tokenize", "conversation"}
)


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or raised while rendering these messages."""


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template, so chat messages cannot be turned into a prompt."""

    def __init__(self, model: str = "this model") -> None:
        super().__init__(
            f"{model} has no chat template (no chat_template in tokenizer_config.json or GGUF metadata), so "
            f"chat messages cannot be formatted; use the completions API with a plain prompt instead"
        )


def _raise_exception(message: str) -> None:
    # Templates call raise_exception('...') to reject conversations (e.g. roles out of order).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # NOTE: jinja2's own tojson HTML-escapes <, >, & and ': prompts must carry them verbatim.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile ``template`` once (cached: every chat request renders the same one)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e} (line {e.lineno})") from e


def render_chat_template(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` (dicts with ``role`` and ``content``) into the prompt string.

    ``extra`` reaches the template as more variables (``tools``, ``enable_thinking``, ...); it may not
    set the variables this function sets. Raises ``NoChatTemplateError`` when ``template`` is None and
    ``ChatTemplateError`` when rendering fails."""
    if template is None:
        raise NoChatTemplateError()
    clash = sorted(set(extra) & (_RENDERER_VARIABLES | _TEMPLATE_FUNCTIONS))
    if clash:
        raise ChatTemplateError(f"template variables {', '.join(clash)} are set by the renderer")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ChatTemplateError(f"message {i} must be a mapping with a 'role', got {message!r}")
    compiled = compile_chat_template(template)
    try:
        return compiled.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **extra,
        )
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, LookupError, ArithmeticError) as e:
        # NOTE: a template is untrusted code over request data (chat_template_kwargs of any JSON type):
        # whatever it raises on these inputs is the request's template failing, not a server bug.
        raise ChatTemplateError(f"chat template failed on these messages: {e}") from e
