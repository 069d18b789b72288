"""``--kv-events-config``: where the KV-cache events go, with vLLM's field names and defaults
(``vllm/config/kv_events.py``), so that a router set up for vLLM reads cbserve the same way."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("zmq", "null")  # null: events are recorded and dropped (vLLM's default publisher)


class KVEventsConfigError(ValueError):
    """An invalid ``--kv-events-config``."""


@dataclass(frozen=True)
class KVEventsConfig:
    """``endpoint``: the ZMQ PUB socket, bound when it names a wildcard host (``tcp://*:5557``) or is an
    ``ipc://`` / ``inproc://`` address, connected otherwise. ``replay_endpoint``: a ROUTER socket (always
    bound) that re-sends the last ``buffer_steps`` batches from a sequence number on; None for none.
    ``topic``: the first frame of every message, for subscribers to filter on. ``hwm``: the PUB socket's
    high-water mark (messages queued per subscriber before ZMQ drops)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise KVEventsConfigError(
                f"enable_kv_cache_events must be a bool, got {self.enable_kv_cache_events!r}"
            )
        if self.publisher not in PUBLISHERS:
            raise KVEventsConfigError(
                f"publisher must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}"
            )
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise KVEventsConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise KVEventsConfigError(
                f"endpoint must be a tcp://, ipc:// or inproc:// address, got {self.endpoint!r}"
            )
        if self.replay_endpoint is not None and not (
            isinstance(self.replay_endpoint, str)
            and self.replay_endpoint.startswith(("tcp://", "ipc://", "inproc://"))
        ):
            raise KVEventsConfigError(
                f"replay_endpoint must be a tcp://, ipc:// or inproc:// address or null, got {self.replay_endpoint!r}"
            )
        for name in ("buffer_steps", "hwm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KVEventsConfigError(f"{name} must be a positive integer, got {value!r}")

    @property
    def publishes(self) -> bool:
        """Whether events are recorded and sent over ZMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """The config from a JSON object of its fields; ``KVEventsConfigError`` naming what is wrong."""
        try:
            value: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KVEventsConfigError(f"expected a JSON object, got {text!r} ({exc})") from None
        if not isinstance(value, dict):
            raise KVEventsConfigError(f"expected a JSON object, got {text!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise KVEventsConfigError(
                f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**value)
