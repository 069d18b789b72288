"""OpenAI request fields -> the engine's ``GenerationConfig`` (the model's defaults, overridden by what
the request sets), and the ``max_tokens`` default.

Rules (vLLM's):
- an unset field keeps the model's ``generation_config.json`` default;
- ``temperature`` 0 is greedy and any other temperature samples (``do_sample = temperature > 0``); an
  unset temperature is the model's default temperature, else 1.0 (OpenAI's and vLLM's default): a
  request samples unless it asks for 0, whatever ``do_sample`` the model's file says (as vLLM does);
- ``bad_words`` (words) become token id sequences, each word with and without a leading space;
- ``top_k`` -1 or 0 disables top-k;
- ``penalty_alpha`` > 0 (contrastive search, with ``top_k`` > 1) is greedy: an unset temperature is 0, any
  other is refused;
- ``max_tokens`` unset: 16 for /v1/completions (OpenAI's documented default), and for chat the model's
  ``max_new_tokens`` default, else ``DEFAULT_CHAT_MAX_TOKENS``; both capped by the room left in the
  context window and in the KV cache, so a default never makes a request fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.admission import check_context_length
from engine.generation.config import GenerationConfig, GenerationConfigError
from engine.generation.grammar_spec import GrammarSpec
from engine.generation.watermark_config import Watermark
from server.beam_search_params import beam_search_options
from server.errors import APIError
from server.schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 1024


def requested_max_tokens(req: SamplingRequest) -> int | None:
    """The completion length the request asks for, if any (chat: ``max_completion_tokens`` first)."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def resolve_max_tokens(
    req: SamplingRequest,
    prompt_len: int,
    max_model_len: int,
    kv_capacity_tokens: int,
    defaults: GenerationConfig,
) -> int:
    """``max_new_tokens`` for one prompt; raises ``ContextLengthExceededError`` when the prompt plus the
    asked-for tokens do not fit the context window."""
    asked = requested_max_tokens(req)
    if asked is None:
        if isinstance(req, CompletionRequest):
            wanted = DEFAULT_COMPLETION_MAX_TOKENS
        else:
            wanted = defaults.max_new_tokens or DEFAULT_CHAT_MAX_TOKENS
        room = min(max_model_len, kv_capacity_tokens) - prompt_len
        # NOTE: at least 1, so that a prompt filling the whole window still gets the clear error below.
        max_new = max(1, min(wanted, room))
    else:
        max_new = asked
    check_context_length(prompt_len, max_new, max_model_len)
    return max_new


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if not raw:
        return None
    out: dict[int, float] = {}
    for key, bias in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(
                400,
                f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                param="logit_bias",
            ) from None
        out[token] = bias
    return out


def _stop_strings(stop: str | list[str] | None) -> list[str] | None:
    if stop is None:
        return None
    values = [stop] if isinstance(stop, str) else list(stop)
    return values or None


def bad_words_ids(words: Sequence[str], tokenizer: Any) -> list[list[int]] | None:
    """vLLM's ``bad_words``: the token ids of each word as it would appear at the start of a text and
    after a space (a BPE tokenizer spells the two differently); words that encode to nothing are
    skipped."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False)) if text.strip() else []
            if ids and ids not in out:
                out.append(ids)
    return out or None


def requested_prompt_logprobs(req: SamplingRequest) -> int | None:
    """vLLM's ``prompt_logprobs``, or completions' ``echo`` with ``logprobs: k`` (the echoed prompt's
    tokens get their log-probabilities and ``k`` alternatives): the larger when both are set."""
    asked = [req.prompt_logprobs]
    echo_k = getattr(req, "logprobs", None)
    if getattr(req, "echo", False) is True and type(echo_k) is int:
        asked.append(echo_k)
    values = [k for k in asked if k is not None]
    return max(values) if values else None


def _temperature(req: SamplingRequest, defaults: GenerationConfig) -> float:
    """The request's temperature, else the model's default; 0 with ``penalty_alpha`` (contrastive search
    chooses its tokens itself: it never samples)."""
    if req.penalty_alpha:
        if req.temperature:
            raise GenerationConfigError(
                "temperature", "must be 0 or unset with penalty_alpha (contrastive search)"
            )
        return 0.0
    return float(req.temperature) if req.temperature is not None else defaults.temperature


def build_generation_config(
    req: SamplingRequest,
    defaults: GenerationConfig,
    max_new_tokens: int,
    output_logprobs: bool,
    top_logprobs: int,
    structured_output: GrammarSpec | None = None,
    bad_words: list[list[int]] | None = None,
    watermark: Watermark | None = None,
) -> GenerationConfig:
    """The validated config for one prompt of ``req`` (raises ``GenerationConfigError`` / ``APIError``).
    ``bad_words``: ``req.bad_words`` as token ids (``bad_words_ids``). ``watermark``: the server's
    default watermark, for a request that names none (a request can replace it, not turn it off)."""
    temperature = _temperature(req, defaults)
    overrides: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": req.min_tokens,
        "num_return_sequences": req.n,
        "top_p": req.top_p,
        "min_p": req.min_p,
        "typical_p": req.typical_p,
        "epsilon_cutoff": req.epsilon_cutoff,
        "eta_cutoff": req.eta_cutoff,
        "no_repeat_ngram_size": req.no_repeat_ngram_size,
        "bad_words_ids": bad_words,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "dola_layers": req.dola_layers,
        "penalty_alpha": float(req.penalty_alpha) if req.penalty_alpha is not None else None,
        "prompt_lookup_num_tokens": req.prompt_lookup_num_tokens,
        "max_matching_ngram_size": req.max_matching_ngram_size,
        "num_assistant_tokens": req.num_assistant_tokens,
        "num_assistant_tokens_schedule": req.num_assistant_tokens_schedule,
        "assistant_early_exit": req.assistant_early_exit,
        "assistant_confidence_threshold": req.assistant_confidence_threshold,
        "logit_bias": _logit_bias(req.logit_bias),
        "stop_strings": _stop_strings(req.stop),
        "stop_token_ids": list(req.stop_token_ids) if req.stop_token_ids else None,
        "seed": req.seed,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "output_logprobs": output_logprobs,
        "top_logprobs": top_logprobs if output_logprobs else 0,
        "prompt_logprobs": requested_prompt_logprobs(req),
        "structured_output": structured_output,
        "watermarking_config": req.watermarking_config if req.watermarking_config is not None else watermark,
        "logits_processor_args": req.logits_processor_args,
        "temperature": temperature,
        "do_sample": temperature > 0,
    }
    if req.top_k is not None:
        overrides["top_k"] = max(req.top_k, 0)
    overrides.update(beam_search_options(req))
    return defaults.merged(**overrides)
