"""A small driver for model tests: runs a model over a paged KV cache with hand-made block tables, without
the scheduler, so model/attention tests do not depend on it.

Blocks are handed out from a scrambled permutation of the cache, so every sequence's pages are
non-contiguous and interleaved with other sequences' pages.

Modes of ``run_greedy`` / ``prompt_logits``:
- ``"one_at_a_time"``: each prompt alone: one prefill, then its decode steps;
- ``"batched"``: all prompts in one ragged prefill batch, then all decode together;
- ``"chunked"``: prompts are prefilled ``chunk`` tokens per step; sequence ``i`` joins at step ``i``, so
  prefill chunks of some sequences share batches with other sequences' decode tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import pytest
import torch

from engine.executor.attention.cpu_kernel import KernelUnavailable, PagedDecodeKernel, load
from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.inputs import BatchInputs
from engine.executor.kv_cache import KVCache

Mode = Literal["one_at_a_time", "batched", "chunked"]
MODES: tuple[Mode, ...] = ("one_at_a_time", "batched", "chunked")


class PagedModel(Protocol):
    def forward(
        self, inputs: BatchInputs, kv_cache: KVCache, decode_kernel: DecodeKernel | None = None
    ) -> torch.Tensor: ...


def cpu_kernel_or_skip() -> PagedDecodeKernel:
    """The CPU decode-attention kernel, or skip the test on a machine without a C compiler."""
    try:
        return load()
    except KernelUnavailable as e:
        pytest.skip(f"CPU kernel unavailable: {e}")


BYTE_EOS = 256  # the byte tokenizer's <eos>: ids 0-255 are the bytes


def save_byte_tokenizer(folder: Path) -> Path:
    """A byte-level tokenizer (256 byte tokens + <eos>, id ``BYTE_EOS``) saved into ``folder`` as
    tokenizer.json: a real tokenizer any machine can build, for tiny models of any vocabulary >= 257."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from engine.loader.tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    vocab["<eos>"] = len(vocab)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder


@dataclass
class _Seq:
    tokens: list[int]
    prompt_len: int
    block_table: list[int]
    num_computed: int = 0
    generated: list[int] = field(default_factory=list)


def scrambled_blocks(num_blocks: int, seed: int = 0) -> list[int]:
    """All block ids in a seeded random order."""
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    return ids


def _assign_tables(lengths: list[int], kv_cache: KVCache, seed: int) -> list[list[int]]:
    free = scrambled_blocks(kv_cache.num_blocks, seed)
    tables: list[list[int]] = []
    for n in lengths:
        need = -(-n // kv_cache.block_size)
        if need > len(free):
            raise ValueError(f"the KV cache has too few blocks ({kv_cache.num_blocks}) for these sequences")
        tables.append(free[:need])
        del free[:need]
    return tables


def _drive(
    model: PagedModel,
    kv_cache: KVCache,
    prompts: list[list[int]],
    max_new_tokens: int,
    mode: Mode,
    chunk: int,
    seed: int,
    on_logits: Callable[[int, torch.Tensor], object] | None = None,
    decode_kernel: DecodeKernel | None = None,
) -> list[list[int]]:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    if chunk < 1 or max_new_tokens < 1 or any(not p for p in prompts):
        raise ValueError("chunk and max_new_tokens must be >= 1 and prompts non-empty")
    tables = _assign_tables([len(p) + max_new_tokens for p in prompts], kv_cache, seed)
    seqs = [_Seq(list(p), len(p), t) for p, t in zip(prompts, tables, strict=True)]
    device = kv_cache.device

    def done(i: int) -> bool:
        return len(seqs[i].generated) >= max_new_tokens

    def step(plan: list[tuple[int, int]]) -> None:
        """Compute ``n`` tokens of sequence ``i`` for each ``(i, n)``; sample where a chunk ends the known
        tokens."""
        ids, starts, blocks, want = [], [], [], []
        for i, n in plan:
            s = seqs[i]
            ids.append(s.tokens[s.num_computed : s.num_computed + n])
            starts.append(s.num_computed)
            blocks.append(s.block_table)
            want.append(s.num_computed + n == len(s.tokens))
        inputs = BatchInputs.build(ids, starts, blocks, want, kv_cache.block_size, device=device)
        logits = model.forward(inputs, kv_cache, decode_kernel)  # [num_logits, vocab]
        row = 0
        for (i, n), w in zip(plan, want, strict=True):
            seqs[i].num_computed += n
            if w:
                if on_logits is not None:
                    on_logits(i, logits[row])
                token = int(logits[row].argmax())
                seqs[i].tokens.append(token)
                seqs[i].generated.append(token)
                row += 1

    def uncomputed(i: int) -> int:
        return len(seqs[i].tokens) - seqs[i].num_computed

    max_steps = sum(len(p) for p in prompts) + len(prompts) * (max_new_tokens + 1) + 8  # a loose bound
    if mode == "one_at_a_time":
        for i in range(len(seqs)):
            while not done(i):
                step([(i, uncomputed(i))])
    elif mode == "batched":
        for _ in range(max_steps):
            active = [i for i in range(len(seqs)) if not done(i)]
            if not active:
                break
            step([(i, uncomputed(i)) for i in active])
    else:
        for t in range(max_steps):
            active = [i for i in range(min(t + 1, len(seqs))) if not done(i)]
            if not active and t >= len(seqs):
                break
            if active:
                step([(i, min(chunk, uncomputed(i))) for i in active])
    if not all(done(i) for i in range(len(seqs))):
        raise RuntimeError("harness did not finish within its step bound")
    return [s.generated for s in seqs]


def run_greedy(
    model: PagedModel,
    kv_cache: KVCache,
    prompts: list[list[int]],
    max_new_tokens: int,
    mode: Mode = "batched",
    chunk: int = 7,
    seed: int = 0,
    decode_kernel: DecodeKernel | None = None,
) -> list[list[int]]:
    """Greedy (argmax) generation of ``max_new_tokens`` tokens per prompt (no EOS stop); returns the new
    tokens of each prompt. The cache must hold every sequence at once (``seed`` scrambles the blocks).
    ``decode_kernel``: decode attention in that kernel (CPU C or GPU Triton) instead of SDPA."""
    return _drive(model, kv_cache, prompts, max_new_tokens, mode, chunk, seed, decode_kernel=decode_kernel)


def prompt_logits(
    model: PagedModel,
    kv_cache: KVCache,
    prompts: list[list[int]],
    mode: Mode = "batched",
    chunk: int = 7,
    seed: int = 0,
    decode_kernel: DecodeKernel | None = None,
) -> torch.Tensor:
    """Logits of each prompt's last token ``[num_prompts, vocab]``, prefilled in ``mode``."""
    rows: dict[int, torch.Tensor] = {}
    _drive(model, kv_cache, prompts, 1, mode, chunk, seed, lambda i, x: rows.setdefault(i, x), decode_kernel)
    return torch.stack([rows[i] for i in range(len(prompts))])


# A tiny random model's config fields (byte tokenizer vocabulary, 2 layers, GQA), for transformers' config
# classes; tests add each architecture's own fields.
TINY_BASE: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=BYTE_EOS,
    pad_token_id=0,
)


def save_tiny(folder: Path, config_class: str, fields: dict[str, Any], seed: int = 0) -> Path:
    """A random model of transformers' ``config_class`` with ``fields`` over ``TINY_BASE`` (a None field is
    left out), saved by transformers with the byte tokenizer."""
    import transformers

    merged = {k: v for k, v in {**TINY_BASE, **fields}.items() if v is not None or k not in TINY_BASE}
    config = getattr(transformers, config_class)(**merged)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return save_byte_tokenizer(folder)
