"""The KV-cache event publisher without a model (server/kv_events.py): the msgpack layout of vLLM's
``KVEventBatch`` byte for byte, and the replay socket answering from a sequence number on, then the end
marker. The live path (a server's events rebuilding its cache) is tests/server/test_kv_events_live.py."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import zmq

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from server.kv_events import END_OF_REPLAY, ZmqEventPublisher, block_hash_bytes, encode_batch
from server.kv_events_config import KVEventsConfig

H1, H2 = 1 << 100, 7  # 128-bit hashes: past msgpack's 64-bit ints, hence bytes on the wire


def test_a_batch_is_vllms_array_like_tagged_structs() -> None:
    events = [
        BlockStored((H1, H2), None, tuple(range(8)), 4),
        BlockStored((H2,), H1, (9, 9, 9, 9), 4),
        BlockRemoved((H1,)),
        AllBlocksCleared(),
    ]
    assert msgpack.unpackb(encode_batch(12.5, events, "CPU")) == [
        12.5,
        [
            [
                "BlockStored",
                [block_hash_bytes(H1), block_hash_bytes(H2)],
                None,
                list(range(8)),
                4,
                None,
                "CPU",
            ],
            ["BlockStored", [block_hash_bytes(H2)], block_hash_bytes(H1), [9, 9, 9, 9], 4, None, "CPU"],
            ["BlockRemoved", [block_hash_bytes(H1)], "CPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    assert block_hash_bytes(H2) == b"\x07" + b"\x00" * 15  # the digest's bytes, little-endian


def test_the_replay_socket_resends_from_a_sequence_number_then_ends(tmp_path: Path) -> None:
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="kv",
    )
    publisher = ZmqEventPublisher(config, "CPU")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        batches = [[BlockRemoved((i,))] for i in range(3)]
        for batch in batches:
            publisher.publish(batch)
        dealer.connect(config.replay_endpoint or "")
        replies: list[tuple[int, bytes]] = []
        for _ in range(100):  # the publisher thread may not have sent all three yet: ask again, bounded
            if len(replies) == 2:
                break
            time.sleep(0.05)
            dealer.send_multipart((b"", (1).to_bytes(8, "big")))
            replies = []
            while True:
                assert dealer.poll(10_000), "the replay socket did not answer"
                _, seq, payload = dealer.recv_multipart()
                if seq == END_OF_REPLAY:
                    assert payload == b""
                    break
                replies.append((int.from_bytes(seq, "big"), payload))
        assert [seq for seq, _ in replies] == [1, 2]
        assert [msgpack.unpackb(p)[1] for _, p in replies] == [
            [["BlockRemoved", [block_hash_bytes(i)], "CPU"]] for i in (1, 2)
        ]
    finally:
        dealer.close(linger=0)
        publisher.close()
