"""The KV-cache event publisher: the engine's events (kvcache/events.py) on a ZMQ PUB socket, as vLLM's
``ZmqEventPublisher`` sends them, so that KV-aware routers (llm-d's KV-cache manager, Dynamo) subscribe to
cbserve as to vLLM.

Wire format, one message per engine step that changed the prefix cache:
- frames ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian counter from 0, so gaps are visible;
- ``payload``: msgpack of ``KVEventBatch`` as vLLM's msgspec structs (``array_like``, tagged) encode it,
  ``[ts, [event, ...], data_parallel_rank]`` with events
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
  ``["BlockRemoved", block_hashes, medium]`` and ``["AllBlocksCleared"]``;
- block hashes are the 16 bytes of their blake2b digest (msgpack ints stop at 64 bits; vLLM also sends
  its hashes as bytes).
Replay (``replay_endpoint``, a ROUTER socket): a REQ/DEALER client sends an 8-byte big-endian start
sequence; every buffered batch from it on comes back as ``(seq, payload)``, then ``(-1, b"")``.

The engine thread only queues events (``publish``); one daemon thread encodes and sends them and answers
replay requests, and owns both sockets.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from server.kv_events_config import KVEventsConfig

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
POLL_INTERVAL_MS = 100  # how often the publisher thread looks at replay requests while nothing is queued
CLOSE_TIMEOUT_S = 2.0
_DIGEST_SIZE = 16  # kvcache/prefix_hash.py: a hash is the int of a 16-byte digest, little-endian


def block_hash_bytes(block_hash: int) -> bytes:
    """The digest a block hash was made from (``kvcache/prefix_hash.py``)."""
    return block_hash.to_bytes(_DIGEST_SIZE, "little")


def encode_event(event: KVCacheEvent, medium: str) -> list[Any]:
    """One event as vLLM's tagged, array-like msgspec struct."""
    if isinstance(event, BlockStored):
        parent = None if event.parent_block_hash is None else block_hash_bytes(event.parent_block_hash)
        hashes = [block_hash_bytes(h) for h in event.block_hashes]
        return ["BlockStored", hashes, parent, list(event.token_ids), event.block_size, None, medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [block_hash_bytes(h) for h in event.block_hashes], medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV-cache event: {event!r}")


def encode_batch(ts: float, events: list[KVCacheEvent], medium: str) -> bytes:
    return msgpack.packb([ts, [encode_event(e, medium) for e in events], 0])


class ZmqEventPublisher:
    """Publishes event batches on ``config.endpoint``; binds (or connects) at construction, so a bad or busy
    endpoint fails the server's start. ``medium`` names where the blocks live (``"GPU"``, ``"CPU"``)."""

    def __init__(self, config: KVEventsConfig, medium: str, context: zmq.Context | None = None) -> None:
        self._config = config
        self._medium = medium
        self._topic = config.topic.encode()
        self._queue: queue.SimpleQueue[tuple[float, list[KVCacheEvent]] | None] = queue.SimpleQueue()
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            self._open(config)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="cbserve-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events (any thread; never blocks). Dropped once the publisher thread has
        stopped (its failure is logged): nothing would take them off the queue."""
        if self._thread.is_alive():
            self._queue.put((time.time(), events))

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("the KV-event publisher did not stop within %.0f s", CLOSE_TIMEOUT_S)

    # ------------------------------------------------------------------ the publisher thread
    def _open(self, config: KVEventsConfig) -> None:
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        if config.replay_endpoint is not None:
            self._replay = self._pub.context.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)

    def _run(self) -> None:
        try:
            while True:
                self._serve_replays()
                try:
                    item = self._queue.get(timeout=POLL_INTERVAL_MS / 1000)
                except queue.Empty:
                    continue
                if item is None:
                    return
                self._send(*item)
        except Exception:  # NOTE: the events are advisory: a broken publisher must not take the server down.
            logger.exception("the KV-event publisher stopped")
        finally:
            self._close_sockets()

    def _send(self, ts: float, events: list[KVCacheEvent]) -> None:
        payload = encode_batch(ts, events, self._medium)
        seq = self._next_seq.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq, payload))
        self._sent.append((self._next_seq, payload))
        self._next_seq += 1

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignoring a malformed KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._sent:
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=int(CLOSE_TIMEOUT_S * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)
