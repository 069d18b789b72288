"""Fixtures of the engine tests: ``tiny_beam_model`` (tests/beam_harness.py's tiny random models)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from beam_harness import TinyModel, save_tiny


@pytest.fixture(scope="session")
def tiny_beam_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], TinyModel]:
    """``tiny_beam_model(config_class, seed)``: a tiny random model of that transformers config class
    (model_harness.TINY_BASE) and seed, saved once per session."""
    made: dict[tuple[str, int], TinyModel] = {}

    def tiny(config_class: str, seed: int) -> TinyModel:
        if (config_class, seed) not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{config_class}-{seed}") / config_class
            made[config_class, seed] = TinyModel(save_tiny(folder, config_class, seed))
        return made[config_class, seed]

    return tiny
