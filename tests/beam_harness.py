"""Beam-search test helpers: tiny random models saved as folders (with the byte tokenizer of
model_harness.py) beside transformers' model and cbserve's engine on them (``TinyModel``: the
``tiny_beam_model`` fixture of tests/engine/conftest.py makes each once per session), and running requests
through a manager with ``check_integrity()`` after every step."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import model_harness
import torch
import transformers

from engine.engine import Engine
from engine.manager import ContinuousBatchingManager
from engine.outputs import GenerationOutput, RequestStatus

PROMPTS = [list(range(40, 47)), [20, 21, 22], list(range(60, 100))]  # 7, 3 and 40 tokens
MAX_NEW = 10


def save_tiny(folder: Path, config_class: str, seed: int) -> Path:
    return model_harness.save_tiny(folder, config_class, {}, seed)


@dataclass
class TinyModel:
    """A tiny random model saved as ``folder``: transformers' model on it (the reference) and cbserve's
    engine on it, each loaded once."""

    folder: Path

    @cached_property
    def reference(self) -> Any:
        return transformers.AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.float32).eval()

    @cached_property
    def engine(self) -> Engine:
        return Engine.from_pretrained(str(self.folder), device="cpu", dtype="float32", num_blocks=256)


def checked_every_step(manager: ContinuousBatchingManager) -> list[BaseException]:
    """``check_integrity()`` after every step of ``manager`` (on its thread); the errors it raised."""
    errors: list[BaseException] = []
    lock = threading.Lock()

    def check(_: int) -> None:
        try:
            manager.scheduler.check_integrity()
        except Exception as exc:
            with lock:
                errors.append(exc)

    manager.add_step_observer(check)
    return errors


def run(
    manager: ContinuousBatchingManager, requests: list[tuple[list[int], dict[str, Any]]]
) -> list[list[GenerationOutput]]:
    """Every request added at once; per request, its final outputs by index."""
    errors = checked_every_step(manager)
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=MAX_NEW, **options) for p, options in requests]
        finals: dict[tuple[str, int], GenerationOutput] = {}
        expected = sum(options.get("num_return_sequences", 1) for _, options in requests)
        while len(finals) < expected:
            out = manager.get_result(timeout=60)
            assert out is not None, "the engine stopped answering"
            if out.is_finished:
                assert out.status is RequestStatus.FINISHED, out.error
                finals[(out.request_id, out.index)] = out
    finally:
        manager.stop(timeout=30)
    assert errors == []
    manager.check_integrity()
    assert manager.scheduler.kv_manager.num_free_blocks == manager.scheduler.num_blocks
    return [
        [finals[(rid, i)] for i in range(options.get("num_return_sequences", 1))]
        for rid, (_, options) in zip(ids, requests, strict=True)
    ]


def options_of(search: dict[str, Any], eos: int | None) -> dict[str, Any]:
    return {**search, "do_sample": False, "eos_token_id": eos, "ignore_eos": eos is None}
