"""The model's tokenizer: a ``tokenizers.Tokenizer`` plus the special tokens and chat template around it.

Built either from a Hugging Face folder (``tokenizer.json`` + ``tokenizer_config.json``) or from a GGUF
file's metadata, which has no ``tokenizer.json``: there we rebuild the byte-level BPE (``tokenizer.ggml.model
== "gpt2"``) from ``tokenizer.ggml.tokens`` and ``.merges``, with the pre-tokenizer split that
``tokenizer.ggml.pre`` names (the regex llama.cpp uses for that vocabulary), control tokens as special
added tokens, and BOS/EOS added as ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from engine.errors import ModelLoadError
from engine.loader.chat_template import NoChatTemplateError, render_chat_template

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer splits by ``tokenizer.ggml.pre`` (the regexes llama.cpp's llama-vocab.cpp uses).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# GPT-2's own regex (ByteLevel's built-in), with every digit split off first: SmolLM's tokenizer.json and
# llama.cpp's "smollm" / "starcoder" pre-tokenizers.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact")
_PLAIN_GPT2 = ("gpt2", "default", "gpt-2")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _byte_level_pre_tokenizer(pre: str | None, where: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre not in _PLAIN_GPT2 and pre is not None:
        # NOTE: as transformers does, fall back to GPT-2's split; it differs from the model's only on
        # rare inputs (e.g. long digit runs), so warn instead of refusing the model.
        logger.warning("%s: unknown tokenizer.ggml.pre %r; using GPT-2's pre-tokenizer", where, pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if token is None or isinstance(token, str):
        return token
    content = token.get("content")
    return content if isinstance(content, str) else None


class Tokenizer:
    """Encode/decode text for one model, with its special tokens and chat template.

    ``vocab_size`` counts the added tokens too: every id ``encode`` can return is below it (the model
    loader checks it against the embedding table)."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        name: str = "tokenizer",
    ) -> None:
        self.backend = backend
        self.name = name
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.bos_token_id = self._id_of(bos_token, "bos_token")
        self.eos_token_id = self._id_of(eos_token, "eos_token")
        self.unk_token_id = self._id_of(unk_token, "unk_token")
        self.pad_token_id = self._id_of(pad_token, "pad_token")
        eos = [] if self.eos_token_id is None else [self.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_token_ids]))
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        named = (self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id)
        special.update(i for i in (*named, *self.eos_token_ids) if i is not None)
        self.all_special_ids: list[int] = sorted(special)

    def _id_of(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"{self.name}: {what} {token!r} is not in the vocabulary")
        return int(token_id)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        """From ``tokenizer.json`` and (optionally) ``tokenizer_config.json`` in ``folder``."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"{path} is not a valid tokenizers file: {e}") from e
        config_path = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as e:
                raise ModelLoadError(f"{config_path} is not valid JSON: {e}") from e
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = by_name.get("default") or next(iter(by_name.values()), None)
        jinja_path = folder / "chat_template.jinja"  # newer transformers save the template on its own
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            unk_token=_token_content(config.get("unk_token")),
            pad_token=_token_content(config.get("pad_token")),
            chat_template=template,
            # NOTE: tokenizer.json's post-processor already adds BOS/EOS; these flags are only recorded.
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            name=str(folder),
        )

    @classmethod
    def from_gguf(cls, reader: GGUFReader, where: str = "GGUF file") -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes (byte-level BPE, ``tokenizer.ggml.model == "gpt2"``)."""
        from engine.loader.gguf import gguf_field

        kind = gguf_field(reader, "tokenizer.ggml.model", None)
        if kind != "gpt2":
            raise ModelLoadError(
                f"{where}: tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
                f"use the model's Hugging Face folder with its tokenizer.json"
            )
        tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
        merges: list[str] = gguf_field(reader, "tokenizer.ggml.merges")
        token_types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
        alphabet = _GPT2_ALPHABET
        spelled = _gpt2_spelling
        vocab = {spelled(tok): i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bad = next((m for m, p in zip(merges, pairs, strict=True) if len(p) != 2), None)
        if bad is not None:
            raise ModelLoadError(f"{where}: malformed tokenizer.ggml.merges entry {bad!r}")
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)  # type: ignore[arg-type]
        backend = BackendTokenizer(bpe)
        backend.pre_tokenizer = _byte_level_pre_tokenizer(
            gguf_field(reader, "tokenizer.ggml.pre", None), where
        )
        backend.decoder = decoders.ByteLevel()
        control, user = _gguf_added_tokens(tokens, token_types, alphabet)
        backend.add_special_tokens(control)
        backend.add_tokens(user)

        def token_of(key: str) -> str | None:
            token_id = gguf_field(reader, f"tokenizer.ggml.{key}_token_id", None)
            if token_id is None:
                return None
            if not 0 <= token_id < len(tokens):
                raise ModelLoadError(f"{where}: tokenizer.ggml.{key}_token_id {token_id} is out of range")
            return spelled(tokens[token_id])

        bos, eos = token_of("bos"), token_of("eos")
        add_bos = bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False))
        add_eos = bool(gguf_field(reader, "tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _bos_eos_post_processor(
            backend, bos if add_bos else None, eos if add_eos else None
        )
        extra_eos = [gguf_field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eot", "eom")]
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            unk_token=token_of("unknown"),
            pad_token=token_of("padding"),
            extra_eos_token_ids=[int(i) for i in extra_eos if i is not None],
            chat_template=gguf_field(reader, "tokenizer.chat_template", None),
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            name=where,
        )

    def save(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (readable by ``from_pretrained`` and by
        transformers' ``AutoTokenizer``)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")

    # ------------------------------------------------------------------ encode / decode
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary + added tokens)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS as the model's tokenizer says."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [
            list(e.ids) for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        ]

    def decode(self, ids: Sequence[int] | int, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (one id or several, as transformers' tokenizers take them)."""
        token_ids = [ids] if isinstance(ids, int) else list(ids)
        return str(self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary entries (byte-level spelling) of ``ids``; ``None`` for an unknown id."""
        return [self.backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int | None]:
        return [self.backend.token_to_id(t) for t in tokens]

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **extra: Any,
    ) -> list[int] | str:
        """Render ``messages`` with the model's chat template; token ids when ``tokenize`` else the text.

        NOTE: the template writes any BOS itself, so the rendered text is encoded without special tokens
        (as transformers does)."""
        if self.chat_template is None:
            raise NoChatTemplateError(self.name)
        text = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"


def _bos_eos_post_processor(
    backend: BackendTokenizer, bos: str | None, eos: str | None
) -> processors.PostProcessor | None:
    """A post-processor that wraps each sequence in BOS/EOS (either may be None), or None for neither."""
    if bos is None and eos is None:
        return None

    def wrap(seq: str, type_id: int) -> str:
        parts = [f"{bos}:{type_id}"] if bos is not None else []
        parts.append(f"${seq}:{type_id}")
        if eos is not None:
            parts.append(f"{eos}:{type_id}")
        return " ".join(parts)

    special = [(tok, backend.token_to_id(tok)) for tok in (bos, eos) if tok is not None]
    return processors.TemplateProcessing(
        single=wrap("A", 0),
        pair=f"{wrap('A', 0)} {wrap('B', 1)}",
        special_tokens=list(dict.fromkeys(special)),  # type: ignore[arg-type]
    )


def _gguf_added_tokens(
    tokens: list[str], token_types: list[int], alphabet: frozenset[str]
) -> tuple[list[AddedToken], list[AddedToken]]:
    """(control, user-defined) tokens of a GGUF vocabulary. Control tokens (<|im_start|>, ...) match whole
    and are skipped by decode(skip_special_tokens); user-defined ones (<think>) match whole but are text."""
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types, strict=True)
        if kind == _TOKEN_TYPE_CONTROL and set(tok) <= alphabet
    ]
    user = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, token_types, strict=True)
        if kind == _TOKEN_TYPE_USER_DEFINED
    ]
    return control, user


_GPT2_SPELLING = bytes_to_unicode()
_GPT2_ALPHABET = frozenset(_GPT2_SPELLING.values())


def _gpt2_spelling(token: str) -> str:
    """Vocabulary entries are spelled in GPT-2's byte alphabet; a raw one (rare) is re-spelled."""
    if set(token) <= _GPT2_ALPHABET:
        return token
    return "".join(_GPT2_SPELLING[b] for b in token.encode("utf-8"))
