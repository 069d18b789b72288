"""The hashes both watermarks are made of, shared by the processor (watermark.py) and the detector
(watermark_detect.py), with transformers' arithmetic operation for operation, so that the same tokens and
key give the same green lists and g-values as ``WatermarkLogitsProcessor`` and
``SynthIDTextWatermarkLogitsProcessor`` built with ``device="cpu"``.

NOTE: the green lists are ``torch.randperm`` draws of a seeded ``torch.Generator``, and a CUDA generator
draws other numbers than a CPU one: they are always drawn on the CPU here, whatever device the model runs
on, so a text is detected the same wherever it was generated.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from engine.generation.watermark_config import GreenlistWatermark, SynthIDWatermark

# transformers' WatermarkLogitsProcessor: a permutation of this many entries, drawn once per hashing key.
HASH_TABLE_SIZE = 1_000_003
# transformers' selfhash looks at this many of the likeliest candidates (taken from the original repo).
SELFHASH_CANDIDATES = 40
# SynthID's hash: a linear congruential generator with newlib/musl parameters, over int64 (wrapping).
LCG_MULTIPLIER = 6364136223846793005
LCG_INCREMENT = 1


# ---------------------------------------------------------------------------------------- green lists
@functools.lru_cache(maxsize=8)
def fixed_table(hashing_key: int) -> torch.Tensor:
    """The permutation of ``[0, HASH_TABLE_SIZE)`` that selfhash seeds read (about 10 ms, 8 MB)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(hashing_key)
    return torch.randperm(HASH_TABLE_SIZE, generator=generator)  # [HASH_TABLE_SIZE]


def greenlist_seed(config: GreenlistWatermark, window: Sequence[int]) -> int:
    """The generator seed of the green list that follows ``window``, the last ``context_width`` tokens
    (for selfhash, the candidate token included)."""
    if config.seeding_scheme == "selfhash":
        table = fixed_table(config.hashing_key)
        ids = torch.tensor(list(window), dtype=torch.int64)  # [context_width]
        a = table[ids % HASH_TABLE_SIZE] + 1
        b = table[ids[-1] % HASH_TABLE_SIZE] + 1
        # NOTE: int64 products that may wrap, as transformers' are.
        seed = int((config.hashing_key * a * b).min().item())
    else:
        seed = config.hashing_key * int(window[-1])
    return seed % (2**64 - 1)


def greenlist_ids(config: GreenlistWatermark, vocab_size: int, window: Sequence[int]) -> torch.Tensor:
    """The green token ids after ``window`` (``greenlist_size`` of them, in draw order)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(greenlist_seed(config, window))
    permutation = torch.randperm(vocab_size, generator=generator)  # [V]
    return permutation[: config.greenlist_size(vocab_size)]


@functools.lru_cache(maxsize=65536)
def _seed_greens(seed: int, vocab_size: int, greenlist_size: int, token: int) -> bool:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return bool((torch.randperm(vocab_size, generator=generator)[:greenlist_size] == token).any())


def is_green(config: GreenlistWatermark, vocab_size: int, window: Sequence[int], token: int) -> bool:
    """Whether ``token`` is in the green list seeded by ``window`` (cached: selfhash asks this 40 times a
    step, and the detector once per scored token)."""
    return _seed_greens(greenlist_seed(config, window), vocab_size, config.greenlist_size(vocab_size), token)


# ---------------------------------------------------------------------------------------- SynthID
@functools.lru_cache(maxsize=8)
def sampling_table(seed: int, size: int) -> torch.Tensor:
    """SynthID's table of g-value bits, drawn once per (seed, size); kept as bytes (at most 16 MB)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(low=0, high=2, size=(size,), generator=generator).to(torch.uint8)  # [size]


def accumulate_hash(current: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """SynthID's hash of ``data``'s last dimension onto ``current`` (shape ``data.shape[:-1]``, or one
    that broadcasts): ``h = (h + d) * LCG_MULTIPLIER + LCG_INCREMENT`` for each element, in int64."""
    for i in range(data.shape[-1]):
        current = torch.add(current, data[..., i])
        current = torch.mul(current, LCG_MULTIPLIER)
        current = torch.add(current, LCG_INCREMENT)
    return current


def context_hashes(contexts: torch.Tensor) -> torch.Tensor:
    """The hash of each context (``[..., ngram_len - 1]`` int64 -> ``[...]``), seeded with 1."""
    ones = torch.ones(contexts.shape[:-1], dtype=torch.int64)
    return accumulate_hash(ones, contexts)


def g_values(config: SynthIDWatermark, context_hash: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The g-values of ``tokens`` [R, T] after contexts hashed to ``context_hash`` [R]: [R, T, depth]."""
    hashed = accumulate_hash(context_hash[:, None], tokens[:, :, None])  # [R, T]
    keys = torch.tensor(config.keys, dtype=torch.int64)  # [depth]
    layered = accumulate_hash(hashed[:, :, None], keys[None, None, :, None])  # [R, T, depth]
    table = sampling_table(config.sampling_table_seed, config.sampling_table_size)
    return table[layered % config.sampling_table_size].long()
