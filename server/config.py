"""The HTTP server's own settings (the engine's are ``Engine.from_pretrained``'s arguments)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.kv_events_config import KVEventsConfig

if TYPE_CHECKING:
    from engine.generation.watermark_config import Watermark

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # 16 MiB: far above any prompt that fits a context window
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_MAX_QUEUE = 256
DEFAULT_GRAMMAR_TIMEOUT_S = 10.0  # engine/grammar_workers.py: a structured output's grammar, compiled
# auto: split <think>...</think> out of chat outputs when the tokenizer has both tokens; think: always;
# none: never (the thinking stays in ``content``). vLLM's parser names for the same format are aliases.
REASONING_PARSERS = ("auto", "think", "none", "qwen3", "deepseek_r1")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")  # server/tool_syntax.py


class ServerConfigError(ValueError):
    """An invalid server setting."""


@dataclass(frozen=True)
class ServerConfig:
    """``served_model_name`` is the only value ``model`` may take in requests (or omit it).
    ``api_key`` None disables authentication. ``cors_origins`` empty disables CORS."""

    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    cors_origins: tuple[str, ...] = field(default_factory=tuple)
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    max_queue: int = DEFAULT_MAX_QUEUE
    grammar_compile_timeout: float = DEFAULT_GRAMMAR_TIMEOUT_S
    reasoning_parser: str = "auto"
    tool_call_parser: str = (
        "auto"  # server/tool_syntax.py: auto (from the chat template), hermes, llama3_json, mistral
    )
    # The watermark of every request that names none, and the one /v1/watermark/detect checks by default:
    # a watermark, or a dict of WatermarkingConfig / SynthIDTextWatermarkingConfig fields (converted).
    watermarking_config: Watermark | None = None
    # KV-cache events for KV-aware routers (server/kv_events.py); off by default, as in vLLM.
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.served_model_name, str) or not self.served_model_name.strip():
            raise ServerConfigError(
                f"served_model_name must be a non-empty string, got {self.served_model_name!r}"
            )
        if self.api_key is not None and not self.api_key:
            raise ServerConfigError("api_key must be a non-empty string or None (no authentication)")
        if (
            isinstance(self.max_body_bytes, bool)
            or not isinstance(self.max_body_bytes, int)
            or self.max_body_bytes < 1
        ):
            raise ServerConfigError(f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}")
        if not isinstance(self.shutdown_timeout, (int, float)) or self.shutdown_timeout < 0:
            raise ServerConfigError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout!r}")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ServerConfigError(f"max_queue must be a positive integer, got {self.max_queue!r}")
        timeout = self.grammar_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ServerConfigError(f"grammar_compile_timeout must be > 0 seconds, got {timeout!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ServerConfigError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ServerConfigError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        self._convert_watermark()
        if not isinstance(self.kv_events, KVEventsConfig):
            raise ServerConfigError(f"kv_events must be a KVEventsConfig, got {self.kv_events!r}")
        if not isinstance(self.cors_origins, tuple) or not all(
            isinstance(o, str) and o for o in self.cors_origins
        ):
            raise ServerConfigError(
                f"cors_origins must be a tuple of non-empty strings, got {self.cors_origins!r}"
            )

    def _convert_watermark(self) -> None:
        # NOTE: imported here: `cbserve --help` reads this module and must not pay for torch.
        from engine.generation.errors import GenerationConfigError
        from engine.generation.watermark_config import watermarking_config_from

        try:
            object.__setattr__(
                self, "watermarking_config", watermarking_config_from(self.watermarking_config)
            )
        except GenerationConfigError as exc:
            raise ServerConfigError(str(exc)) from None


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"2GiB"`` -> 2147483648; also KB/MB/GB (powers of 1000), KiB/MiB/GiB/TiB and plain integers."""
    match = _BYTES_RE.match(text)
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 1073741824, 512MiB, 2GiB or 4GB")
    value = int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value
