"""kv_aware's parts against SGLang 0.5.23's own bytes: block hashes recorded from its native hash
extension, an event batch encoded by its own msgspec classes (`tests/data/sglang_0.5.23_*`),
the `/server_info` descriptor, the index's bound, the self-check."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from trio_pd.control.engine_info import parse_kv_events
from trio_pd.fleet.kv_check import MIN_SAMPLES, SelfCheck
from trio_pd.fleet.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    RankFeed,
    decode_batch,
)
from trio_pd.fleet.kv_hash import block_hashes, cacheable_tokens
from trio_pd.fleet.kv_index import BlockIndex
from trio_pd_testing.engine.kv_events import page_hashes

DATA = Path(__file__).parent.parent / "data"


def test_block_hashes_are_the_engines() -> None:
    recorded = json.loads((DATA / "sglang_0.5.23_block_hashes.json").read_text())
    ids = recorded["token_ids"]
    for size, hashes in recorded["pages"].items():
        assert block_hashes(ids, int(size), 1 << 20) == hashes, size
        assert page_hashes(ids, int(size)) == hashes, size  # the simulator's own copy
    assert block_hashes(ids, 4, 3) == recorded["pages"]["4"][:3]  # bounded
    assert block_hashes(ids[:3], 4, 100) == []  # only full pages are stored


def test_cacheable_tokens_leave_one_to_compute() -> None:
    assert cacheable_tokens(40, 4) == 36
    assert cacheable_tokens(41, 4) == 40
    assert cacheable_tokens(1, 1) == 0


def test_an_engine_encoded_batch_decodes() -> None:
    payload = (DATA / "sglang_0.5.23_kv_event_batch.msgpack").read_bytes()
    events, unknown = decode_batch(payload)
    assert unknown == 0
    stored, removed, cleared = events
    assert isinstance(stored, BlockStored) and stored.block_size == 4
    assert stored.block_hashes == [6064031615711592133, -4267769581995769941]
    assert stored.parent_block_hash is None and stored.medium == "GPU"
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [-4267769581995769941]
    assert isinstance(cleared, AllBlocksCleared)


def test_an_unknown_event_type_is_skipped_and_counted() -> None:
    import msgspec

    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockMoved", "x": 1}, {"type": "AllBlocksCleared"}], 0]
    )
    events, unknown = decode_batch(payload)
    assert unknown == 1 and isinstance(events[0], AllBlocksCleared)


def test_the_descriptor_and_the_host_rule() -> None:
    info = parse_kv_events({
        "publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "",
        "block_size": 16, "dp_size": 2, "replay_endpoint_port_base": 5560,
    })  # fmt: skip
    assert info is not None
    assert info.endpoints("10.0.0.5") == [
        ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5560"),
        ("tcp://10.0.0.5:5558", "tcp://10.0.0.5:5561"),
    ]
    assert info.endpoints("::1")[0][0] == "tcp://[::1]:5557"
    concrete = parse_kv_events({**_base(), "endpoint_host": "192.168.1.9"})
    assert concrete is not None and concrete.endpoints("10.0.0.5")[0] == (
        "tcp://192.168.1.9:5557",
        None,
    )
    for bad in (
        None,
        {**_base(), "publisher": "null"},
        {**_base(), "endpoint_port_base": 65535, "dp_size": 2},
        {**_base(), "block_size": 0},
        {**_base(), "replay_endpoint_port_base": "x"},
        {**_base(), "endpoint_host": ""},
    ):
        assert parse_kv_events(bad) is None, bad


def _base() -> dict[str, object]:
    return {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "",
            "block_size": 1, "dp_size": 1}  # fmt: skip


def test_the_index_is_bounded_oldest_first() -> None:
    index = BlockIndex(4)
    index.store([1, 2, 3])
    index.store([4, 5])
    assert list(index.blocks) == [2, 3, 4, 5] and index.dropped == 1
    assert index.prefix([2, 3, 9, 4]) == 2
    index.store([2])  # stored again: the newest
    index.store([6])
    assert 3 not in index.blocks and 2 in index.blocks


def test_the_self_check_trips_and_clears() -> None:
    check = SelfCheck("p")
    for _ in range(MIN_SAMPLES - 1):
        check.observe(0, 90, 100)
    assert not check.tripped  # too few samples yet
    check.observe(0, 90, 100)
    assert check.tripped
    for _ in range(20):
        check.observe(50, 50, 100)
    assert not check.tripped and check.error < 0.1


async def test_a_feed_without_a_replay_socket_starts_partial() -> None:
    feed = RankFeed("tcp://127.0.0.1:9", None, "", 10)
    await feed._replay(None, 0)  # type: ignore[arg-type]  # no socket is opened without one
    assert feed.partial and feed.next_seq is None
    await trio.lowlevel.checkpoint()
