"""The model's inputs for one step: one flattened ragged batch, no padding between sequences."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchInputs:
    """Every tensor is on the model's device.

    Sequences are concatenated, the ``num_decode_seqs`` decoding ones (one new token each) first, shortest
    KV first, then the ones computing several tokens (prefill chunks): attention handles the parts apart, so
    one long chunk does not pad every decode query, and decodes of similar lengths can share a padded
    gather. Sequence ``i`` (in this order) owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``; its KV length after this step is ``seq_lens[i]``
    (cached context + new tokens); its pages are ``block_tables[i, :ceil(seq_lens[i]/block_size)]``.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset where K/V are written
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int64, KV length of each sequence after this step
    logits_indices: torch.Tensor  # [num_logits] int64, rows of the flat batch that need logits
    max_query_len: int
    max_seq_len: int
    block_size: int
    num_decode_seqs: int = 0  # the first sequences, one query token each
    decode_seq_lens: tuple[int, ...] = ()  # their KV lengths (ascending), on the host
    prefill_query_lens: tuple[int, ...] = ()  # new tokens of each of the other sequences, on the host
    prefill_seq_lens: tuple[int, ...] = ()  # and their KV lengths after this step
    # (logits row, layers): the row's logits are DoLa's contrast of the last layer with those layers
    # (engine/executor/dola.py)
    early_exits: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # rows of the flat batch whose final-norm hidden state the forward returns too (contrastive search);
    # None: none
    hidden_indices: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        starts: list[int],
        block_tables: list[list[int]],
        logits_rows: Sequence[int],
        block_size: int,
        device: torch.device | str = "cpu",
        exit_layers: Sequence[tuple[int, ...]] | None = None,
        hidden_rows: Sequence[int] | None = None,
    ) -> BatchInputs:
        """Build from Python lists: sequence ``i`` computes ``token_ids[i]`` at positions from ``starts[i]``
        (the tokens before are in its pages); ``logits_rows[i]`` asks for the logits of its last
        ``logits_rows[i]`` new tokens (0, 1 to sample, or all for prompt logprobs; a bool is 0 or 1), in the
        order of the arguments, a sequence's rows in position order; ``hidden_rows`` likewise for final hidden
        states. ``exit_layers[i]``: DoLa's candidate layers for sequence ``i``'s last logits row (or none)."""
        order = decode_first_order(token_ids, starts)
        last_row: dict[int, int] = {}
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        if not (len(token_ids) == len(starts) == len(block_tables) == len(logits_rows)):
            raise ValueError(
                "token_ids, starts, block_tables and logits_rows must have one entry per sequence"
            )
        num_decode = sum(len(x) == 1 for x in token_ids)
        for i in order:
            ids, start, table = token_ids[i], starts[i], block_tables[i]
            n = len(ids)
            input_ids.extend(ids)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            last_row[i] = qsl[-1] - 1
        logits_indices = _logits_indices(last_row, logits_rows)
        max_blocks = max((len(t) for t in block_tables), default=0)
        tables = [block_tables[i] + [0] * (max_blocks - len(block_tables[i])) for i in order]
        t = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        return cls(
            input_ids=t(input_ids),
            positions=t(positions),
            slot_mapping=t(slots),
            block_tables=t(tables) if tables else torch.zeros((0, 0), dtype=torch.int64, device=device),
            query_start_loc=t(qsl),
            seq_lens=t(seq_lens),
            logits_indices=t(logits_indices),
            max_query_len=max((len(x) for x in token_ids), default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
            num_decode_seqs=num_decode,
            decode_seq_lens=tuple(seq_lens[:num_decode]),
            prefill_query_lens=tuple(qsl[j + 1] - qsl[j] for j in range(num_decode, len(seq_lens))),
            prefill_seq_lens=tuple(seq_lens[num_decode:]),
            early_exits=_early_exits(logits_rows, exit_layers),
            hidden_indices=_hidden_indices(last_row, hidden_rows, t),
        )


def _early_exits(
    logits_rows: Sequence[int], exit_layers: Sequence[tuple[int, ...]] | None
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(logits row, layers) of each sequence with DoLa layers: its last logits row."""
    if exit_layers is None:
        return ()
    ends = list(itertools.accumulate(int(r) for r in logits_rows))
    return tuple(
        (ends[i] - 1, tuple(layers)) for i, layers in enumerate(exit_layers) if layers and logits_rows[i]
    )


def _hidden_indices(
    last_row: dict[int, int], hidden_rows: Sequence[int] | None, tensor: Callable[[list[int]], torch.Tensor]
) -> torch.Tensor | None:
    """The flat rows whose final hidden state is returned (None: none), as ``_logits_indices``."""
    return tensor(_logits_indices(last_row, hidden_rows)) if hidden_rows and any(hidden_rows) else None


def _logits_indices(last_row: dict[int, int], logits_rows: Sequence[int]) -> list[int]:
    """The flat rows that need logits: sequence ``i``'s last ``logits_rows[i]`` rows, in argument order."""
    return [
        row for i, n in enumerate(logits_rows) for row in range(last_row[i] - int(n) + 1, last_row[i] + 1)
    ]


def decode_first_order(token_ids: list[list[int]], starts: list[int]) -> list[int]:
    """The order ``BatchInputs.build`` lays sequences out in: the decoding ones (one new token) first, by
    ascending KV length, then the rest in the caller's order. Logits rows keep the caller's order."""
    return sorted(range(len(token_ids)), key=lambda i: (0, starts[i]) if len(token_ids[i]) == 1 else (1, 0))
