"""ServerConfig validates itself with clear errors."""

from __future__ import annotations

from typing import Any

import pytest

from engine.generation.watermark_config import SynthIDWatermark
from server.config import ServerConfig, ServerConfigError


def test_valid_config() -> None:
    config = ServerConfig(served_model_name="m", api_key="k", cors_origins=("http://a",), max_body_bytes=10)
    assert config.max_queue > 0 and config.shutdown_timeout >= 0
    assert config.watermarking_config is None


def test_watermark_default_is_converted() -> None:
    config = ServerConfig(served_model_name="m", watermarking_config={"ngram_len": 5, "keys": [1, 2]})  # type: ignore[arg-type]
    assert config.watermarking_config == SynthIDWatermark(ngram_len=5, keys=(1, 2))


@pytest.mark.parametrize(
    ("fields", "word"),
    [
        ({"served_model_name": " "}, "served_model_name"),
        ({"api_key": ""}, "api_key"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"max_body_bytes": True}, "max_body_bytes"),
        ({"shutdown_timeout": -1}, "shutdown_timeout"),
        ({"max_queue": 0}, "max_queue"),
        ({"grammar_compile_timeout": 0}, "grammar_compile_timeout"),
        ({"cors_origins": ["http://a"]}, "cors_origins"),
        ({"cors_origins": ("",)}, "cors_origins"),
        ({"watermarking_config": {"bias": None}}, "watermarking_config.bias"),
        ({"watermarking_config": "selfhash"}, "watermarking_config"),
    ],
)
def test_invalid_values_raise(fields: dict[str, Any], word: str) -> None:
    with pytest.raises(ServerConfigError, match=word):
        ServerConfig(**{"served_model_name": "m", **fields})
