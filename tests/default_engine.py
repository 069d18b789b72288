"""Engines on the default model loaded once: ``engine_on(loaded, **cache_options)`` is
``Engine.from_pretrained("default", device="cpu", dtype="float32", **cache_options)`` on an already loaded
model (the session's ``default_model`` fixture, tests/conftest.py): its own KV cache, prefix cache, decode
stack and manager, on the same read-only weights. Loading the model (GGUF dequantization, prepacked weights)
costs seconds; an engine on it a fraction of one."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from engine.cpu.openmp_pools import on_scratch_thread
from engine.engine import CacheOptions, Engine
from engine.loader.model_loader import LoadedModel, resolve_device

# What every engine on the shared model was loaded with (``load_default``): other load options (a dtype,
# batch invariance, the transformers backend, no prepacking, ranks) need their own ``from_pretrained``.
LOAD_OPTIONS: dict[str, Any] = dict(device="cpu", dtype="float32")


def load_default(dtype: str = LOAD_OPTIONS["dtype"]) -> LoadedModel:
    """The default model as ``Engine.from_pretrained("default", **LOAD_OPTIONS)`` loads it (its engines are
    batch-invariant: ``Engine.batch_invariant``); in ``dtype`` instead when given."""
    engine = Engine.from_pretrained("default", num_blocks=1, **{**LOAD_OPTIONS, "dtype": dtype})
    return engine.loaded


def engine_on(loaded: LoadedModel, attention_backend: str = "auto", **cache_options: Any) -> Engine:
    """A new engine on ``loaded`` with ``cache_options`` (``CacheOptions``' fields; None: the default), set
    up as ``Engine.from_pretrained`` sets one up (on a scratch thread: no OpenMP pool left on this one)."""
    options = CacheOptions(**{k: v for k, v in cache_options.items() if v is not None})
    name = loaded.source.name or "default"
    return on_scratch_thread(lambda: Engine(loaded, options, name, attention_backend))


# What ``engine_on`` takes besides the loaded model.
ENGINE_OPTIONS = {f.name for f in dataclasses.fields(CacheOptions)} | {"attention_backend"}


def reuse_default_loads(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Until ``monkeypatch`` undoes it, ``Engine.from_pretrained`` of the default model on the CPU in float32
    with engine options only (what a bench script loads) is ``engine_on(loaded, ...)`` instead of a second
    load of the same weights; any other load goes through."""
    load = Engine.from_pretrained

    def from_pretrained(
        model: str = "default", device: str = "auto", dtype: str = "auto", **options: Any
    ) -> Engine:
        if (
            model == "default"
            and resolve_device(device).type == "cpu"
            and dtype == LOAD_OPTIONS["dtype"]
            and options.keys() <= ENGINE_OPTIONS
        ):
            return engine_on(loaded, **options)
        return load(model, device=device, dtype=dtype, **options)

    monkeypatch.setattr(Engine, "from_pretrained", from_pretrained)
