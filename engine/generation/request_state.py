"""One sample's generation state: its RNG, detokenizer and stopping, fed one token at a time.

The streamed text is exactly the final text: ``delta_text`` pieces concatenate to ``text``. Text that may
still become a stop string (a tail that is a prefix of one) is held back until a later token shows it is
not, or the sequence ends; a matched stop string and everything after it are never emitted (OpenAI). The
text of a final EOS or stop token is not part of the output (vLLM), whatever ``skip_special_tokens`` says.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.generation.config import GenerationConfig
from engine.generation.detokenizer import IncrementalDetokenizer, TokenDecoder
from engine.generation.grammar import GrammarMatcher
from engine.generation.rng import RequestRNG
from engine.generation.rows import SamplingRow
from engine.generation.stop_strings import StopStringMatcher
from engine.generation.stopping import StoppingCriteria
from engine.generation.user_processors import RequestHooks
from engine.outputs import TokenLogprob
from scheduler.request import FinishReason


@dataclass(frozen=True)
class TokenResult:
    delta_text: str  # text new since the previous result
    finish_reason: FinishReason | None  # set when this token ended the sequence
    text: str  # all text so far (the concatenation of every delta_text)


class RequestGenerationState:
    """``on_token(token_id, logprob, now)`` after each sampled token; ``finish(reason)`` when the engine
    ends the sequence itself (context full, abort) so held-back text is released.

    ``eos_token_ids``: the model's EOS ids (used unless the config names its own, or ``ignore_eos``).
    ``sample_index``: which of the request's ``num_return_sequences`` samples (its own RNG stream).
    ``max_new_tokens``: the engine's resolved limit (default: the config's, else ``DEFAULT_MAX_NEW_TOKENS``).
    ``start_time``: monotonic start for ``max_time`` (default: now).
    ``grammar``: the sample's matcher when its output is constrained; every token but a final stop token
    advances it, and it is dropped when the sequence ends.
    ``hooks``: the request's own logits processors and stopping criteria (engine/generation/user_processors.py);
    a criterion that says stop ends the sequence with ``FinishReason.STOP`` (its last token kept, as
    transformers keeps it), once ``min_new_tokens`` allow it.
    """

    def __init__(
        self,
        config: GenerationConfig,
        prompt_ids: Sequence[int],
        tokenizer: TokenDecoder,
        eos_token_ids: Sequence[int] = (),
        sample_index: int = 0,
        max_new_tokens: int | None = None,
        start_time: float | None = None,
        grammar: GrammarMatcher | None = None,
        hooks: RequestHooks | None = None,
    ) -> None:
        self.config = config
        self.hooks = hooks
        self.prompt_ids = prompt_ids
        self.sample_index = sample_index
        self.rng = RequestRNG(config.seed, sample_index)
        self.criteria = StoppingCriteria(config, eos_token_ids, max_new_tokens, start_time)
        self.detokenizer = IncrementalDetokenizer(tokenizer, config.skip_special_tokens)
        self.stop_matcher = StopStringMatcher(config.stop_string_list)
        self.grammar = grammar
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: FinishReason | None = None
        self.stop_string_matched: str | None = None
        self._text = ""  # stable detokenized text, stop-truncated once a stop string matched
        self._emitted = 0  # length of self._text already handed out

    # ------------------------------------------------------------------ views
    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The text emitted so far (held-back text excluded)."""
        return self._text[: self._emitted]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.criteria.eos_token_ids

    def sampling_row(self, output_ids: Sequence[int] | None = None) -> SamplingRow:
        """This sample's row for ``Sampler.sample`` (``output_ids`` defaults to the tokens seen here)."""
        return SamplingRow(
            config=self.config,
            prompt_ids=self.prompt_ids,
            output_ids=self.output_ids if output_ids is None else output_ids,
            rng=self.rng,
            eos_token_ids=self.criteria.eos_token_ids,
            grammar=self.grammar,
            hooks=self.hooks,
        )

    # ------------------------------------------------------------------ updates
    def on_token(
        self, token_id: int, logprob: TokenLogprob | None = None, now: float | None = None
    ) -> TokenResult:
        if self.finish_reason is not None:
            raise RuntimeError(f"token {token_id} after the sequence finished ({self.finish_reason.value})")
        now = time.monotonic() if now is None else now
        is_stop = self.criteria.is_stop_token(token_id, len(self.output_ids) + 1)
        if self.grammar is not None and not is_stop:
            self.grammar.accept_token(token_id)  # NOTE: raises before the token joins the output
        self.output_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        n = len(self.output_ids)

        reason: FinishReason | None = None
        if is_stop:
            reason = FinishReason.STOP  # its text is not part of the output
        else:
            checked = len(self._text)
            self._text += self.detokenizer.add(token_id)
            if self.stop_matcher and self.criteria.may_stop(n):
                reason = self._match_stop_string(checked)
            if reason is None and self._user_criteria_stop(n):
                reason = FinishReason.STOP
        if reason is None:
            reason = self.criteria.length_or_time(n, now)
        if reason is not None:
            return self._finish(reason)
        hold = self.stop_matcher.partial_suffix_len(self._text) if self.stop_matcher else 0
        return self._emit(max(self._emitted, len(self._text) - hold))

    def finish(self, reason: FinishReason) -> TokenResult:
        """End the sequence now (no new token): release held-back and undecoded text."""
        if self.finish_reason is not None:
            return TokenResult("", self.finish_reason, self.text)
        return self._finish(reason)

    def _user_criteria_stop(self, num_output_tokens: int) -> bool:
        if self.hooks is None or not self.hooks.stopping_criteria:
            return False
        if (
            num_output_tokens < self.config.min_new_tokens
        ):  # NOTE: the token stays: it counts toward the minimum
            return False
        return self.hooks.should_stop([*self.prompt_ids, *self.output_ids])

    def _match_stop_string(self, checked: int) -> FinishReason | None:
        pos = self.stop_matcher.find(self._text, checked)
        if pos is None:
            return None
        for s in self.stop_matcher.stop_strings:
            if self._text.startswith(s, pos):
                self.stop_string_matched = s
                break
        self._text = self._text[:pos]
        return FinishReason.STOP

    def _finish(self, reason: FinishReason) -> TokenResult:
        if self.stop_string_matched is None:
            # nothing more can complete a stop string: flush the detokenizer's pending bytes too
            self._text += self.detokenizer.finish()
        self.finish_reason = reason
        self.grammar = None  # NOTE: a finished sequence samples no more: free the matcher now.
        return self._emit(len(self._text))

    def _emit(self, upto: int) -> TokenResult:
        delta = self._text[self._emitted : upto]
        self._emitted = upto
        return TokenResult(delta, self.finish_reason, self._text[:upto])
