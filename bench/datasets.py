"""Benchmark workloads: the prompts a run sends, built with the served model's tokenizer.

Every workload yields `SampleRequest`s whose `prompt_len` is the prompt's exact token count under that
tokenizer (no special tokens), so input lengths are what the server sees before its chat template or BOS.

- `random`: random token ids (never special ones), decoded, re-encoded and trimmed or padded until the
  text re-encodes to exactly the wanted length (vLLM's `gen_prompt_decode_to_target_len`).
- `sharegpt`: a local ShareGPT JSON file; the first human turn is the prompt and the token length of the
  reply that follows is the output length; pairs too short or too long are dropped as vLLM does.
- `prefix-repetition`: a few random shared prefixes, each followed by many random suffixes: the workload
  that exercises a prefix cache.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

# vLLM's ShareGPT filter (benchmarks/datasets.py: is_valid_sequence).
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
# Bounded re-tokenization: a few rounds nearly always reach the exact length; after that we accept the
# closest text and report its true length rather than loop forever.
MAX_LENGTH_RETRIES = 10

_HUMAN_ROLES = frozenset({"human", "user"})


@runtime_checkable
class TokenizerLike(Protocol):
    """What the benchmark needs of a tokenizer (engine.loader.model_loader.load_tokenizer returns one)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    """One prompt of a workload: its text, its exact token count and how many tokens to ask for."""

    prompt: str
    prompt_len: int
    expected_output_len: int


def special_token_ids(tokenizer: TokenizerLike) -> frozenset[int]:
    """The ids a random prompt must avoid: declared special ids, and any id whose text vanishes when
    special tokens are skipped (added control tokens such as `<|im_start|>` that a tokenizer may not list).
    """
    declared: set[int] = set()
    for attr in ("all_special_ids", "special_ids", "special_token_ids"):
        value = getattr(tokenizer, attr, None)
        if value is not None and not callable(value):
            declared.update(int(i) for i in value)
    found: set[int] = set()
    try:
        for token_id in range(tokenizer.vocab_size):
            shown = tokenizer.decode([token_id], skip_special_tokens=False)
            if shown and not tokenizer.decode([token_id], skip_special_tokens=True):
                found.add(token_id)
    except TypeError:
        # NOTE: a tokenizer whose decode() lacks skip_special_tokens=True support: trust the declared set.
        found = set()
    return frozenset(declared | found)


class TokenSampler:
    """Draws random token ids from a tokenizer's vocabulary minus its special ids, reproducibly."""

    def __init__(self, tokenizer: TokenizerLike, rng: np.random.Generator) -> None:
        specials = special_token_ids(tokenizer)
        allowed = np.array([i for i in range(tokenizer.vocab_size) if i not in specials], dtype=np.int64)
        if allowed.size == 0:
            raise ValueError("the tokenizer has no non-special token ids to build random prompts from")
        self.tokenizer = tokenizer
        self.allowed = allowed
        self.rng = rng

    def sample(self, count: int) -> list[int]:
        if count <= 0:
            return []
        return [int(i) for i in self.rng.choice(self.allowed, size=count)]

    def exact_length_prompt(self, target_len: int) -> tuple[str, int]:
        """A text that re-encodes to `target_len` tokens, and its true length (equal unless retries ran out).

        Decoding random ids and re-encoding the text does not give the same ids back (BPE merges across
        token boundaries), so trim or pad with fresh random ids and try again, as vLLM does.
        """
        if target_len < 1:
            raise ValueError(f"a prompt needs at least 1 token, got {target_len}")
        token_ids = self.sample(target_len)
        prompt = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        for _ in range(MAX_LENGTH_RETRIES):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            if len(token_ids) == target_len:
                return prompt, target_len
            if len(token_ids) < target_len:
                token_ids = token_ids + self.sample(target_len - len(token_ids))
            else:
                token_ids = token_ids[:target_len]
            prompt = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        return prompt, len(self.tokenizer.encode(prompt, add_special_tokens=False))


def _length_range(mean: int, range_ratio: float, minimum: int) -> tuple[int, int]:
    """Inclusive [low, high] of lengths uniformly spread `range_ratio` around `mean` (vLLM's rounding)."""
    low = max(int(mean * (1 - range_ratio)), minimum)
    high = max(int(mean * (1 + range_ratio)), low)
    return low, high


def sample_random_requests(
    tokenizer: TokenizerLike,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prompts` random prompts of about `input_len` tokens asking for about `output_len` tokens each;
    lengths are drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)]."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input and output lengths must be >= 1, got {input_len} and {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_low, in_high = _length_range(input_len, range_ratio, minimum=1)
    out_low, out_high = _length_range(output_len, range_ratio, minimum=1)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    sampler = TokenSampler(tokenizer, rng)
    requests = []
    for in_len, out_len in zip(input_lens, output_lens, strict=True):
        prompt, true_len = sampler.exact_length_prompt(int(in_len))
        requests.append(SampleRequest(prompt, true_len, int(out_len)))
    return requests


def sample_prefix_repetition_requests(
    tokenizer: TokenizerLike,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prompts` prompts over `num_prefixes` shared random prefixes (prompt i uses prefix i mod
    num_prefixes), each followed by its own random suffix; shuffled so that prefixes interleave."""
    if num_prompts < 1 or num_prefixes < 1:
        raise ValueError(f"num_prompts and num_prefixes must be >= 1, got {num_prompts} and {num_prefixes}")
    if prefix_len < 1 or suffix_len < 1 or output_len < 1:
        raise ValueError(
            f"prefix, suffix and output lengths must be >= 1, got {prefix_len}, {suffix_len}, {output_len}"
        )
    rng = np.random.default_rng(seed)
    sampler = TokenSampler(tokenizer, rng)
    prefixes = [sampler.exact_length_prompt(prefix_len)[0] for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        suffix, _ = sampler.exact_length_prompt(suffix_len)
        # NOTE: the text is prefix + suffix, so the shared part is byte-identical across prompts; BPE may
        # merge across the seam, so the length is measured on the joined text.
        prompt = prefixes[i % num_prefixes] + suffix
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(SampleRequest(prompt, prompt_len, output_len))
    order = rng.permutation(num_prompts)
    return [requests[int(i)] for i in order]


def _first_exchange(conversation: object) -> tuple[str, str] | None:
    """The first human turn and the turn answering it, or None when the conversation has no such pair."""
    if not isinstance(conversation, list):
        return None
    for i, turn in enumerate(conversation[:-1]):
        if not isinstance(turn, dict) or turn.get("from") not in _HUMAN_ROLES:
            continue
        reply = conversation[i + 1]
        if not isinstance(reply, dict) or reply.get("from") in _HUMAN_ROLES:
            return None
        prompt, completion = turn.get("value"), reply.get("value")
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt, completion
        return None
    return None


def is_valid_sharegpt_pair(prompt_len: int, output_len: int, fixed_output_len: bool) -> bool:
    """vLLM's filter: prompts (and natural outputs) under 4 tokens, prompts over 1024 tokens or pairs over
    2048 tokens in all are dropped."""
    if prompt_len < SHAREGPT_MIN_LEN:
        return False
    if not fixed_output_len and output_len < SHAREGPT_MIN_LEN:
        return False
    return prompt_len <= SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN


def sample_sharegpt_requests(
    tokenizer: TokenizerLike,
    dataset_path: str | Path,
    num_prompts: int,
    output_len: int | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prompts` prompts from a ShareGPT JSON file (a list of {"conversations": [{"from", "value"}]}).

    Entries are shuffled with `seed` and tokenized until enough pass the filter; when the file holds fewer
    valid pairs than asked for, valid ones are drawn again at random (vLLM's oversampling).
    `output_len` replaces the reply's token length when given.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    path = Path(dataset_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read ShareGPT JSON from {path}: {exc}") from exc
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")
    pairs = [
        pair
        for entry in data
        if isinstance(entry, dict) and (pair := _first_exchange(entry.get("conversations"))) is not None
    ]
    rnd = random.Random(seed)
    rnd.shuffle(pairs)
    requests: list[SampleRequest] = []
    for prompt, completion in pairs:
        if len(requests) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        if output_len is None:
            wanted = len(tokenizer.encode(completion, add_special_tokens=False))
        else:
            wanted = output_len
        if is_valid_sharegpt_pair(prompt_len, wanted, fixed_output_len=output_len is not None):
            requests.append(SampleRequest(prompt, prompt_len, wanted))
    if not requests:
        raise ValueError(f"{path}: no conversation passed the ShareGPT length filter")
    if len(requests) < num_prompts:
        requests += rnd.choices(requests, k=num_prompts - len(requests))
    return requests
