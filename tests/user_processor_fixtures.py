"""Server logits processors for the tests of ``--logits-processors`` (engine/generation/user_processors.py),
imported by spec (``user_processor_fixtures:BanToken``) with tests/ on the import path."""

from __future__ import annotations

from typing import Any

import torch

from engine.generation.user_processors import ProcessorRow


class BanToken:
    """Bans ``args["ban_token_id"]`` in each row that names it; raises for a row whose args hold
    ``"fail": true``, and returns NaN logits for a row whose args hold ``"nan": true``."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, rows: list[ProcessorRow], logits: torch.Tensor) -> torch.Tensor:
        for j, row in enumerate(rows):
            if row.args.get("fail"):
                raise RuntimeError("asked to fail")
            if row.args.get("nan"):
                logits[j] = float("nan")
            token = row.args.get("ban_token_id")
            if token is not None:
                logits[j, int(token)] = float("-inf")
        return logits


class WrongShape:
    """Drops the last column of every row it sees."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        pass

    def __call__(self, rows: list[ProcessorRow], logits: torch.Tensor) -> torch.Tensor:
        return logits[:, :-1]


class FailsToBuild:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        raise RuntimeError("no configuration found")

    def __call__(self, rows: list[ProcessorRow], logits: torch.Tensor) -> torch.Tensor:
        return logits


class TakesOnlyLogits:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        pass

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class NotCallable:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        pass


NOT_A_CLASS = 42
