"""Grammar-constrained decoding behind one small interface, on ``llguidance`` (why that library:
docs/GENERATION.md).

- ``GrammarCompiler``: the tokenizer's vocabulary, and ``compile(spec) -> CompiledGrammar``, cached by
  spec (least recently used first out; a rejected spec is remembered too, so a repeated bad one costs
  nothing). Called at admission, on a worker thread of engine/generation/grammar_workers.py: a spec the
  library rejects raises ``GenerationConfigError`` naming the spec's request field. llguidance bounds the
  work of a grammar with its parser limits (lexer fuel, grammar size, nesting depth), so a pathological
  schema fails, not hangs: ``GrammarTooComplexError``, the message saying it is too complex.
- ``CompiledGrammar.matcher(max_new_tokens)``: a fresh ``GrammarMatcher`` per sequence; for a JSON
  grammar with a token budget, it closes the output before the budget cuts it
  (engine/generation/grammar_closing.py).
- ``GrammarMatcher``: ``fill_bitmask`` (the tokens allowed next, one bit each), ``accept_token``,
  ``is_terminated``, ``rollback``, ``copy`` (n > 1 forks). The engine applies every constrained row's
  bitmask in one op (engine/generation/grammar_mask.py).

EOS: once the grammar is complete (``is_accepting``), the sequence's own EOS ids are allowed too; once it
can take nothing more (``is_terminated``) EOS is all that is left. Stop tokens end the sequence and are
never fed to the matcher.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import llguidance
import torch

from engine.generation.errors import GenerationConfigError, GrammarTooComplexError
from engine.generation.grammar_closing import ClosingBudget, ClosingPlanner, signed_bit
from engine.generation.grammar_literals import unwritable_character
from engine.generation.grammar_spec import GrammarSpec

MAX_CACHED_GRAMMARS = 128
# NOTE: llguidance logs warnings to stderr at level 1; errors reach the caller through is_error instead.
_LOG_LEVEL = 0
# Words of llguidance's errors about its limits (nesting depth, grammar size, lexer fuel, regex states):
# such a spec is well-formed but too costly, and the message says so.
_LIMIT_WORDS = ("limit", "too large", "too big", "too many", "too complex", "fuel", "unable to determine")
_WHAT = {"json_schema": "schema", "json_object": "schema", "regex": "regex", "choice": "choice"}
_LIBRARY_FORMAT = {
    "json_schema": "json_schema",
    "json_object": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


class BackendTokenizer(Protocol):
    """What the compiler needs of a tokenizer: its HF ``tokenizers`` backend (engine/loader/tokenizer.py)."""

    @property
    def backend(self) -> object: ...


class GrammarMatcherError(RuntimeError):
    """The matcher refused a token or failed: the sequence cannot go on (its request fails)."""


def bitmask_words(vocab_size: int) -> int:
    """Int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, closing: ClosingBudget | None = None) -> None:
        self._matcher = matcher
        self._closing = closing  # None: nothing steers the output closed before max_new_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, eos_token_ids: Sequence[int] = ()) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, CPU, contiguous; bit ``t % 32`` of
        word ``t // 32`` set when token ``t`` is allowed); when the grammar is complete, ``eos_token_ids``
        are allowed too."""
        self._check()
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        self._check()
        if eos_token_ids and self._matcher.is_accepting():
            for t in eos_token_ids:
                if t < 32 * words.numel():
                    # NOTE: int32 words: bit 31 set is the sign bit, so OR in a signed value.
                    words[t // 32] |= signed_bit(t % 32)
        if self._closing is not None:
            self._closing.restrict(self._matcher, words, eos_token_ids)

    def accept_token(self, token_id: int) -> None:
        """Advance past ``token_id``; raises ``GrammarMatcherError`` when the grammar does not allow it."""
        if not self._matcher.consume_token(token_id):
            raise GrammarMatcherError(f"the grammar does not allow token {token_id}: {self._error()}")
        if self._closing is not None:
            self._closing.num_accepted += 1

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids``, in order, the grammar allows from here (the state does not change):
        speculative decoding's drafts are cut there."""
        return int(self._matcher.validate_tokens(list(token_ids)))

    def is_accepting(self) -> bool:
        """The output so far is complete (EOS may come next)."""
        return bool(self._matcher.is_accepting())

    def is_terminated(self) -> bool:
        """Nothing but EOS can follow."""
        return bool(self._matcher.is_stopped())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if not self._matcher.rollback(num_tokens):
            raise GrammarMatcherError(f"cannot roll back {num_tokens} tokens: {self._error()}")
        if self._closing is not None:
            self._closing.num_accepted -= num_tokens

    def copy(self) -> GrammarMatcher:
        """An independent matcher in this one's state (a forked sample)."""
        return GrammarMatcher(self._matcher.deep_copy(), self._closing.copy() if self._closing else None)

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarMatcherError(self._error())

    def _error(self) -> str:
        return str(self._matcher.get_error()).split("\n<state>")[0] or "no error message"


# NOTE: a closed JSON value is a complete answer; a free-text reply or regex match cut short only looks
# like one, so only these kinds are closed before the budget ends (engine/generation/grammar_closing.py).
CLOSING_KINDS = frozenset({"json_schema", "json_object"})


class CompiledGrammar:
    """A spec compiled against one vocabulary: a matcher at the start, copied for each sequence."""

    def __init__(
        self, spec: GrammarSpec, start: llguidance.LLMatcher, planner: ClosingPlanner | None
    ) -> None:
        self.spec = spec
        self._start = start
        self._planner = planner if spec.kind in CLOSING_KINDS else None

    def matcher(self, max_new_tokens: int | None = None) -> GrammarMatcher:
        """A matcher at the start; with ``max_new_tokens``, a JSON output is closed within that budget."""
        closing = None
        if self._planner is not None and max_new_tokens is not None:
            closing = ClosingBudget(self._planner, max_new_tokens)
        return GrammarMatcher(self._start.deep_copy(), closing)


class GrammarCompiler:
    """Compiles ``GrammarSpec``s for one tokenizer; thread-safe (callers' threads compile concurrently).

    ``vocab_size``: the sampler's vocabulary (the model's; bitmasks have ``bitmask_words(vocab_size)``
    words per row). ``eos_token_ids``: the model's EOS ids, allowed once a grammar is complete.
    """

    def __init__(
        self,
        tokenizer: BackendTokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        if not eos_token_ids:
            raise ValueError(
                "a grammar compiler needs the model's EOS ids (a complete grammar allows only EOS)"
            )
        to_str = getattr(tokenizer.backend, "to_str", None)
        if to_str is None:
            raise ValueError(f"{tokenizer!r} has no HF tokenizers backend: structured outputs need one")
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self._tokenizer = llguidance.LLTokenizer(to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar | GenerationConfigError] = OrderedDict()
        self._lock = threading.Lock()
        self._planner: ClosingPlanner | None = None  # built at the first compile (it reads the vocabulary)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (cached); ``GenerationConfigError`` naming ``spec.field`` when
        the library rejects it."""
        cached = self.cached(spec)
        if cached is not None:
            return cached
        try:
            start = self._start_matcher(spec)
        except GenerationConfigError as exc:
            self._remember(spec, exc)
            raise
        with self._lock:
            if self._planner is None:
                self._planner = ClosingPlanner(self._tokenizer, self.vocab_size)
            compiled = CompiledGrammar(spec, start, self._planner)
        self._remember(spec, compiled)
        return compiled

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        """The compiled grammar of ``spec`` if it is cached; raises its error again (naming this spec's
        field) if the spec was rejected; None when it was never compiled (or was evicted)."""
        with self._lock:
            entry = self._cache.get(spec)
            if entry is not None:
                self._cache.move_to_end(spec)
        if isinstance(entry, GenerationConfigError):
            reason = str(entry).removeprefix(f"{entry.field}: ")
            raise type(entry)(spec.field, reason)
        return entry

    @property
    def num_cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def _remember(self, spec: GrammarSpec, entry: CompiledGrammar | GenerationConfigError) -> None:
        with self._lock:
            self._cache[spec] = entry
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)

    def _start_matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        character = unwritable_character(self._tokenizer, spec)
        if character is not None:
            raise GenerationConfigError(
                spec.field,
                f"the character U+{ord(character):04X} cannot be written with this model's vocabulary "
                "(it has no token for some of its bytes)",
            )
        try:
            grammar = llguidance.grammar_from(_LIBRARY_FORMAT[spec.kind], spec.text)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            raise GenerationConfigError(spec.field, f"invalid {spec.kind}: {exc}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=_LOG_LEVEL)
        if not matcher.is_error():
            # NOTE: the first mask builds the lexer's start state: a grammar too costly for the parser
            # limits fails here, at admission, instead of on the engine thread.
            matcher.compute_bitmask()
        if matcher.is_error():
            message = str(matcher.get_error()).split("\n<state>")[0]
            if any(word in message.lower() for word in _LIMIT_WORDS):
                what = _WHAT.get(spec.kind, spec.kind)
                raise GrammarTooComplexError(spec.field, f"{what} too complex: {message}")
            raise GenerationConfigError(spec.field, f"invalid {spec.kind}: {message}")
        return matcher
