"""Per-request generation options: Hugging Face ``GenerationConfig`` semantics for decoder-only text
generation, plus the OpenAI / vLLM sampling fields a server needs.

Every option is per request: requests with different configs share one batch (see ``sampler.py``).
A config is frozen; ``merged(**overrides)`` makes a request's config over the model's default.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.generation.constraints import Constraint, constraints_of
from engine.generation.errors import GenerationConfigError
from engine.generation.grammar_spec import GrammarSpec
from engine.generation.speculation import MAX_SPECULATIVE_TOKENS, SCHEDULES
from engine.generation.watermark_config import Watermark, watermarking_config_from

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "GenerationConfig", "GenerationConfigError"]
# Used when neither the request nor the model's generation_config.json sets max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 256
# OpenAI caps top_logprobs at 20; so do we (the sampler's top-k over the vocabulary stays cheap).
MAX_TOP_LOGPROBS = 20
# OpenAI's documented ranges.
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "repetition_penalty",
    "length_penalty",
    "diversity_penalty",
    "max_time",
    "presence_penalty",
    "frequency_penalty",
)
_INT_FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "top_k",
    "no_repeat_ngram_size",
    "num_return_sequences",
    "num_beams",
    "num_beam_groups",
    "top_logprobs",
    "seed",
    "prompt_logprobs",
)
_BOOL_FIELDS = ("do_sample", "output_logprobs", "ignore_eos", "skip_special_tokens")


@dataclass(frozen=True)
class GenerationConfig:
    """How to generate one request's tokens. Defaults follow ``transformers.GenerationConfig``.

    Greedy decoding when ``do_sample`` is False or ``temperature == 0`` (OpenAI's convention); the
    sampling warpers (temperature, top_k, top_p, min_p, typical_p, epsilon/eta cutoffs) only apply when
    sampling. ``max_new_tokens=None`` lets the caller decide (``DEFAULT_MAX_NEW_TOKENS`` if the model has
    no default). ``eos_token_id=None`` means the model's EOS ids.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float | None = None
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: list[list[int]] | None = None
    # {(token ids...): bias}; the HF list form [[[ids], bias], ...] is accepted and converted.
    sequence_bias: dict[tuple[int, ...], float] | None = None
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None
    eos_token_id: int | list[int] | None = None
    stop_strings: str | list[str] | None = None
    max_time: float | None = None
    num_return_sequences: int = 1
    output_logprobs: bool = False
    top_logprobs: int = 0
    # None: off; k >= 0: every prompt token's log-probability (from the raw logits), with the k most likely
    # alternatives at its position (vLLM's ``prompt_logprobs``). The first token has none.
    prompt_logprobs: int | None = None
    seed: int | None = None
    # OpenAI
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    # vLLM
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Structured outputs: what the output must match (engine/generation/grammar_spec.py).
    structured_output: GrammarSpec | None = None
    # A watermark on the output (engine/generation/watermark_config.py): one of ours, a dict or a
    # transformers WatermarkingConfig / SynthIDTextWatermarkingConfig.
    watermarking_config: Watermark | None = None
    # The arguments of the server's logits processors for this request (engine/generation/user_processors.py):
    # None leaves the request out of them.
    logits_processor_args: dict[str, Any] | None = None
    # DoLa (engine/executor/dola.py): contrast the last layer with "low" or "high" layers or a list of them.
    dola_layers: str | list[int] | None = None
    # Contrastive search (engine/contrastive_group.py): with top_k > 1, each token chosen among the top_k
    # by (1 - penalty_alpha) * probability - penalty_alpha * degeneration penalty (0 or None: off).
    penalty_alpha: float | None = None
    # Beam search (engine/generation/beam_search.py): num_return_sequences of the num_beams best hypotheses.
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    # Diverse beam search (engine/generation/diverse_beam_search.py): the beams in groups, penalised for
    # choosing the tokens the earlier groups chose at the same step.
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0
    # Constrained beam search (engine/generation/constrained_beam_search.py): words the output must contain,
    # a list of token ids each (or a list of such lists: one of them), and/or constraint objects
    # (engine/generation/constraints.py: PhrasalConstraint, DisjunctiveConstraint).
    force_words_ids: list[Any] | None = None
    constraints: list[Constraint] | None = None
    # Speculative decoding (engine/speculative/): prompt lookup for this request with up to this many drafts
    # a step (0: none, whatever the server does), n-grams of up to ``max_matching_ngram_size`` tokens; over
    # the server's --speculative-config, the drafts per step and how they adapt.
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None
    num_assistant_tokens: int | None = None
    num_assistant_tokens_schedule: str | None = None
    # Self-speculative decoding: the model's first layers draft (transformers' names).
    assistant_early_exit: int | None = None
    assistant_confidence_threshold: float | None = None

    def __post_init__(self) -> None:
        # NOTE: JSON gives ints for floats, string keys for logit_bias and lists for sequence_bias keys;
        # normalize once here so every reader sees one type per field.
        set_ = object.__setattr__
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                set_(self, name, float(value))
        if self.logit_bias is not None:
            set_(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        if self.sequence_bias is not None:
            set_(self, "sequence_bias", _normalize_sequence_bias(self.sequence_bias))
        for name in ("bad_words_ids",):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                set_(self, name, [list(v) if isinstance(v, (list, tuple)) else v for v in value])
        for name in ("suppress_tokens", "begin_suppress_tokens", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, tuple):
                set_(self, name, list(value))
        if isinstance(self.eos_token_id, tuple):
            set_(self, "eos_token_id", list(self.eos_token_id))
        if isinstance(self.stop_strings, tuple):
            set_(self, "stop_strings", list(self.stop_strings))
        if isinstance(self.dola_layers, tuple):
            set_(self, "dola_layers", list(self.dola_layers))
        if isinstance(self.penalty_alpha, int) and not isinstance(self.penalty_alpha, bool):
            set_(self, "penalty_alpha", float(self.penalty_alpha))
        # NOTE: validates as it converts (a GenerationConfigError naming watermarking_config.<field>).
        set_(self, "watermarking_config", watermarking_config_from(self.watermarking_config))
        self.validate()

    # ------------------------------------------------------------------ derived views
    @property
    def is_greedy(self) -> bool:
        """Greedy (argmax) decoding: ``do_sample`` off, or temperature 0 (OpenAI)."""
        return (not self.do_sample) or self.temperature == 0.0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple (empty when unset: the caller uses the model's)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def stop_string_list(self) -> list[str]:
        if self.stop_strings is None:
            return []
        if isinstance(self.stop_strings, str):
            return [self.stop_strings]
        return list(self.stop_strings)

    def max_new_tokens_or(self, default: int = DEFAULT_MAX_NEW_TOKENS) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else default

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model_defaults(cls, d: Mapping[str, Any] | None) -> GenerationConfig:
        """A config from a model's ``generation_config.json`` dict. Unknown keys (``max_length``,
        ``pad_token_id``, ``transformers_version``, ...) are ignored, and so are nulls."""
        if not d:
            return cls()
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        return cls(**kwargs)

    def merged(self, **overrides: Any) -> GenerationConfig:
        """A new validated config: ``overrides`` (a request's fields) over this one (the model default).

        A ``None`` value means "not set by the request" and keeps the default, since a request cannot
        sensibly unset a model default. An unknown key raises ``GenerationConfigError`` naming it.
        """
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(k for k in overrides if k not in names)
        if unknown:
            raise GenerationConfigError(
                unknown[0], f"unknown generation option (known: {', '.join(sorted(names))})"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, **given)

    # ------------------------------------------------------------------ validation
    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``GenerationConfigError`` (field name + why) for values that cannot work; with
        ``vocab_size``, also for token ids outside ``[0, vocab_size)``."""
        self._validate_types()
        self._validate_ranges()
        self._validate_token_lists()
        self._validate_biases()
        self._validate_stop_strings()
        self._validate_structured_output()
        self._validate_logits_processor_args()
        self._validate_dola_layers()
        self._validate_contrastive_search()
        self._validate_beams()
        self._validate_speculation()
        if vocab_size is not None:
            self._validate_vocab(vocab_size)

    def _validate_types(self) -> None:
        """Every field has its declared type (and floats are finite)."""
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise GenerationConfigError(name, f"must be a boolean, got {getattr(self, name)!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in ("max_new_tokens", "seed", "prompt_logprobs"):
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise GenerationConfigError(name, f"must be an integer, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if value is None and name in ("min_p", "max_time"):
                continue
            if not isinstance(value, float):
                raise GenerationConfigError(name, f"must be a number, got {value!r}")
            if not math.isfinite(value):
                raise GenerationConfigError(name, f"must be finite, got {value!r}")

    def _validate_dola_layers(self) -> None:
        layers = self.dola_layers
        if layers is None or layers in ("low", "high"):
            return
        valid = isinstance(layers, list) and bool(layers)
        if not valid or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
            raise GenerationConfigError(
                "dola_layers",
                f"must be 'low', 'high' or a non-empty list of layer indices >= 0, got {layers!r}",
            )

    @property
    def is_contrastive_search(self) -> bool:
        """transformers' rule: ``penalty_alpha`` > 0 with ``top_k`` > 1 (and no beams)."""
        alpha = self.penalty_alpha
        return alpha is not None and alpha > 0 and self.top_k > 1 and not self.is_beam_search

    def _validate_contrastive_search(self) -> None:
        """``penalty_alpha`` in [0, 1], and what contrastive search cannot be combined with: it chooses each
        token itself (no sampling, beams, drafts or contrast of layers) for one output (n = 1), from the
        logits processors of cbserve only (no grammar, no user processors)."""
        alpha = self.penalty_alpha
        if alpha is None:
            return
        if not isinstance(alpha, float) or not 0.0 <= alpha <= 1.0:
            raise GenerationConfigError("penalty_alpha", f"must be a number in [0, 1], got {alpha!r}")
        if alpha == 0.0 or self.top_k <= 1:
            return
        for name, value in (
            ("do_sample", not self.is_greedy or None),
            ("num_beams", self.num_beams if self.is_beam_search else None),
            ("num_return_sequences", self.num_return_sequences if self.num_return_sequences > 1 else None),
            ("dola_layers", self.dola_layers),
            ("structured_output", self.structured_output),
            ("logits_processor_args", self.logits_processor_args),
            ("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens or None),
            ("assistant_early_exit", self.assistant_early_exit),
        ):
            if value is not None:
                raise GenerationConfigError(
                    name, "cannot be combined with contrastive search (penalty_alpha)"
                )

    @property
    def is_beam_search(self) -> bool:
        return self.num_beams > 1

    def _validate_beams(self) -> None:
        """Beam search's own fields, and what it cannot be combined with."""
        if self.num_beams < 1:
            raise GenerationConfigError("num_beams", f"must be >= 1, got {self.num_beams}")
        if self.early_stopping not in (True, False, "never") or type(self.early_stopping) not in (bool, str):
            raise GenerationConfigError(
                "early_stopping", f'must be true, false or "never", got {self.early_stopping!r}'
            )
        if self.num_beam_groups < 1:
            raise GenerationConfigError("num_beam_groups", f"must be >= 1, got {self.num_beam_groups}")
        if self.diversity_penalty < 0:
            raise GenerationConfigError("diversity_penalty", f"must be >= 0, got {self.diversity_penalty}")
        if self.num_beam_groups > 1:
            self._validate_beam_groups()
        if self.force_words_ids is not None or self.constraints is not None:
            self._validate_constraints()
        if not self.is_beam_search:
            return
        if self.num_return_sequences > self.num_beams:
            raise GenerationConfigError(
                "num_return_sequences",
                f"({self.num_return_sequences}) must not exceed num_beams ({self.num_beams})",
            )
        # NOTE: a beam is pruned and forked by its score alone: what needs one sequence's own history
        # (text, a grammar's state, a clock, another model's layers) is not carried across beams.
        for name, value in (
            ("stop_strings", self.stop_strings),
            ("structured_output", self.structured_output),
            ("watermarking_config", self.watermarking_config),
            ("dola_layers", self.dola_layers),
            ("max_time", self.max_time),
            ("logits_processor_args", self.logits_processor_args),
            ("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens or None),
            ("assistant_early_exit", self.assistant_early_exit),
        ):
            if value is not None:
                raise GenerationConfigError(name, "cannot be combined with beam search (num_beams > 1)")

    @property
    def all_constraints(self) -> list[Constraint]:
        """``constraints`` and the constraints of ``force_words_ids``."""
        forced = constraints_of(self.force_words_ids) if self.force_words_ids is not None else []
        return [*(self.constraints or []), *forced]

    def _validate_constraints(self) -> None:
        """Constrained beam search: beams, no groups, no sampling (as transformers requires)."""
        if self.constraints is not None and (
            not self.constraints or not all(isinstance(c, Constraint) for c in self.constraints)
        ):
            raise GenerationConfigError(
                "constraints", "must be a non-empty list of PhrasalConstraint or DisjunctiveConstraint"
            )
        if self.force_words_ids is not None:
            if not isinstance(self.force_words_ids, list):
                raise GenerationConfigError(
                    "force_words_ids", f"must be a list of token id lists, got {self.force_words_ids!r}"
                )
            try:
                constraints_of(self.force_words_ids)
            except (ValueError, TypeError, IndexError) as exc:
                raise GenerationConfigError("force_words_ids", str(exc)) from None
        field = "force_words_ids" if self.force_words_ids is not None else "constraints"
        if not self.is_beam_search:
            raise GenerationConfigError(field, "needs beam search (num_beams > 1)")
        if self.num_beam_groups > 1 or not self.is_greedy:
            raise GenerationConfigError(field, "cannot be combined with num_beam_groups > 1 or do_sample")

    def _validate_beam_groups(self) -> None:
        """Diverse beam search: groups that divide the beams, a penalty that makes them differ, no sampling
        (as transformers' group beam search requires)."""
        if self.num_beams % self.num_beam_groups:
            raise GenerationConfigError(
                "num_beam_groups", f"({self.num_beam_groups}) must divide num_beams ({self.num_beams})"
            )
        if self.diversity_penalty <= 0:
            raise GenerationConfigError(
                "diversity_penalty", "must be > 0 with num_beam_groups > 1 (else the groups are the same)"
            )
        if not self.is_greedy:
            raise GenerationConfigError(
                "do_sample", "diverse beam search (num_beam_groups > 1) does not sample"
            )

    def _validate_speculation(self) -> None:
        for name, low, high in (
            ("prompt_lookup_num_tokens", 0, MAX_SPECULATIVE_TOKENS),
            ("max_matching_ngram_size", 1, 64),
            ("num_assistant_tokens", 1, MAX_SPECULATIVE_TOKENS),
            ("assistant_early_exit", 1, 1 << 10),
        ):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise GenerationConfigError(name, f"must be an integer in [{low}, {high}], got {value!r}")
        schedule = self.num_assistant_tokens_schedule
        if schedule is not None and schedule not in SCHEDULES:
            raise GenerationConfigError(
                "num_assistant_tokens_schedule", f"must be one of {', '.join(SCHEDULES)}, got {schedule!r}"
            )
        threshold = self.assistant_confidence_threshold
        if threshold is not None and (
            isinstance(threshold, bool)
            or not isinstance(threshold, int | float)
            or not 0.0 <= threshold < 1.0
        ):
            raise GenerationConfigError(
                "assistant_confidence_threshold", f"must be in [0, 1), got {threshold!r}"
            )
        if self.prompt_lookup_num_tokens and self.assistant_early_exit is not None:
            raise GenerationConfigError(
                "assistant_early_exit", "cannot be combined with prompt_lookup_num_tokens"
            )
        for name in ("prompt_lookup_num_tokens", "assistant_early_exit"):
            if self.dola_layers is not None and getattr(self, name):
                raise GenerationConfigError(name, "cannot be combined with dola_layers")

    def _validate_ranges(self) -> None:
        """Every number is in the range where it means something."""
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise GenerationConfigError("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise GenerationConfigError("min_new_tokens", f"must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise GenerationConfigError(
                "min_new_tokens",
                f"({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})",
            )
        if self.temperature < 0:
            raise GenerationConfigError(
                "temperature", f"must be >= 0 (0 means greedy), got {self.temperature}"
            )
        if self.top_k < 0:
            raise GenerationConfigError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise GenerationConfigError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.typical_p <= 1.0:
            raise GenerationConfigError("typical_p", f"must be in (0, 1], got {self.typical_p}")
        for name in ("epsilon_cutoff", "eta_cutoff"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise GenerationConfigError(name, f"must be in [0, 1) (0 disables it), got {value}")
        if self.repetition_penalty <= 0:
            raise GenerationConfigError(
                "repetition_penalty", f"must be > 0 (1 disables it), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise GenerationConfigError(
                    name, f"must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}], got {value}"
                )
        if self.no_repeat_ngram_size < 0:
            raise GenerationConfigError(
                "no_repeat_ngram_size", f"must be >= 0 (0 disables it), got {self.no_repeat_ngram_size}"
            )
        if self.max_time is not None and self.max_time <= 0:
            raise GenerationConfigError("max_time", f"must be > 0 seconds, got {self.max_time}")
        if self.num_return_sequences < 1:
            raise GenerationConfigError(
                "num_return_sequences", f"must be >= 1, got {self.num_return_sequences}"
            )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise GenerationConfigError(
                "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.top_logprobs > 0 and not self.output_logprobs:
            raise GenerationConfigError("top_logprobs", "needs output_logprobs=True")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise GenerationConfigError(
                "prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}"
            )

    def _validate_token_lists(self) -> None:
        for name in ("suppress_tokens", "begin_suppress_tokens", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None:
                _check_ids(name, value)
        if self.eos_token_id is not None:
            _check_ids(
                "eos_token_id",
                [self.eos_token_id] if isinstance(self.eos_token_id, int) else self.eos_token_id,
            )
        if self.bad_words_ids is not None:
            if not isinstance(self.bad_words_ids, list) or not self.bad_words_ids:
                raise GenerationConfigError("bad_words_ids", "must be a non-empty list of token id lists")
            for seq in self.bad_words_ids:
                if not isinstance(seq, list) or not seq:
                    raise GenerationConfigError(
                        "bad_words_ids", f"each entry must be a non-empty list, got {seq!r}"
                    )
                _check_ids("bad_words_ids", seq)

    def _validate_biases(self) -> None:
        if self.sequence_bias is not None:
            if not self.sequence_bias:
                raise GenerationConfigError("sequence_bias", "must not be empty")
            for ids, bias in self.sequence_bias.items():
                if not ids:
                    raise GenerationConfigError(
                        "sequence_bias", "a biased sequence must hold at least one token"
                    )
                _check_ids("sequence_bias", ids)
                _check_finite("sequence_bias", bias)
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                _check_ids("logit_bias", [token])
                _check_finite("logit_bias", bias)
                if not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
                    raise GenerationConfigError(
                        "logit_bias",
                        f"bias of token {token} must be in "
                        f"[{LOGIT_BIAS_RANGE[0]}, {LOGIT_BIAS_RANGE[1]}], got {bias}",
                    )

    def _validate_stop_strings(self) -> None:
        if self.stop_strings is None:
            return
        values = [self.stop_strings] if isinstance(self.stop_strings, str) else self.stop_strings
        if not isinstance(values, list):
            raise GenerationConfigError(
                "stop_strings", f"must be a string or a list of strings, got {values!r}"
            )
        for s in values:
            if not isinstance(s, str):
                raise GenerationConfigError("stop_strings", f"must hold strings, got {s!r}")
            if not s:
                raise GenerationConfigError("stop_strings", "an empty stop string would stop at once")

    def _validate_structured_output(self) -> None:
        spec = self.structured_output
        if spec is None:
            return
        if not isinstance(spec, GrammarSpec):
            raise GenerationConfigError("structured_output", f"must be a GrammarSpec, got {spec!r}")
        if self.ignore_eos:
            # NOTE: a complete grammar allows only EOS; ignoring it would leave no token to sample.
            raise GenerationConfigError("ignore_eos", "cannot be combined with structured output")

    def _validate_logits_processor_args(self) -> None:
        args = self.logits_processor_args
        if args is None:
            return
        if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
            raise GenerationConfigError(
                "logits_processor_args", f"must be an object with string keys, got {args!r}"
            )

    def _validate_vocab(self, vocab_size: int) -> None:
        def check(name: str, ids: Iterable[int]) -> None:
            for t in ids:
                if t >= vocab_size:
                    raise GenerationConfigError(
                        name, f"token id {t} is outside the vocabulary [0, {vocab_size})"
                    )

        for name in ("suppress_tokens", "begin_suppress_tokens", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None:
                check(name, value)
        check("eos_token_id", self.eos_token_ids)
        for seq in self.bad_words_ids or []:
            check("bad_words_ids", seq)
        for ids in self.sequence_bias or {}:
            check("sequence_bias", ids)
        check("logit_bias", self.logit_bias or {})


def _check_ids(name: str, ids: Iterable[Any]) -> None:
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool):
            raise GenerationConfigError(name, f"token ids must be integers, got {t!r}")
        if t < 0:
            raise GenerationConfigError(name, f"token ids must be >= 0, got {t}")


def _check_finite(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise GenerationConfigError(name, f"biases must be finite numbers, got {value!r}")


def _normalize_logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise GenerationConfigError("logit_bias", f"must be a mapping of token id to bias, got {value!r}")
    out: dict[int, float] = {}
    for k, v in value.items():
        try:
            token = int(k) if isinstance(k, str) else k
        except ValueError:
            raise GenerationConfigError("logit_bias", f"keys must be token ids, got {k!r}") from None
        out[token] = float(v) if isinstance(v, int) and not isinstance(v, bool) else v
    return out


def _normalize_sequence_bias(value: Any) -> dict[tuple[int, ...], float]:
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, list):  # HF's list form: [[[ids], bias], ...]
        items = []
        for entry in value:
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise GenerationConfigError(
                    "sequence_bias", f"list entries must be [token_ids, bias], got {entry!r}"
                )
            items.append((entry[0], entry[1]))
    else:
        raise GenerationConfigError("sequence_bias", f"must be a dict or a list, got {value!r}")
    out: dict[tuple[int, ...], float] = {}
    for ids, bias in items:
        key = (ids,) if isinstance(ids, int) else tuple(ids)
        out[key] = float(bias) if isinstance(bias, int) and not isinstance(bias, bool) else bias
    return out
