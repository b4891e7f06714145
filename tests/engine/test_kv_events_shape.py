"""The simulator's KV events and `kv_events` descriptor have the real engine's shapes (recorded
from a real SGLang 0.5.23 prefill by `tests/sglang/test_kv_aware_real.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import trio
import zmq

from tests.conftest import start_engine
from tests.sglang.scenarios import shape, shape_differences

RECORD = Path(__file__).parent.parent / "data" / "sglang_0.5.23_kv_events.json"
CONFIG = json.dumps(
    {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
)


# The recording holds one event of each kind: its lists' lengths follow the prompt, and a first
# block's parent is null where a later one's is a hash (the comparison's rules, scenarios.py).
EVENT_RULES = {"any_length": ["block_hashes", "token_ids"], "optional": ["parent_block_hash"]}


async def test_the_simulators_kv_events_have_the_engines_shapes(nursery: trio.Nursery) -> None:
    recorded = json.loads(RECORD.read_text())
    engine = await start_engine(nursery, "prefill", kv_events_config=CONFIG)
    info = engine.state.kv.describe()
    assert shape_differences(recorded["server_info_kv_events"], shape(info)) == []
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{info['endpoint_port_base']}")
    try:
        checked: set[str] = set()
        while "BlockStored" not in checked:  # a PUB drops what it sent before the subscription
            engine.state.kv.flush()  # AllBlocksCleared, then a prompt's BlockStored
            engine.state.kv.prefill(0, tuple(range(100, 140)))
            await trio.sleep(0.05)
            while sub.poll(0):
                frames = sub.recv_multipart()
                assert len(frames) == recorded["frames"]
                assert len(frames[1]) == recorded["seq_bytes"]
                batch = msgspec.msgpack.decode(frames[2])
                assert len(batch) == recorded["batch"]["length"]
                assert shape(batch[0]) == recorded["batch"]["ts"]
                assert shape(batch[2]) == recorded["batch"]["attn_dp_rank"]
                for event in batch[1]:
                    kind = event["type"]
                    if kind in recorded["batch"]["events"]:
                        wanted = recorded["batch"]["events"][kind]
                        found = shape_differences(wanted, shape(event), rules=EVENT_RULES)
                        assert found == [], (kind, found)
                    checked.add(kind)
    finally:
        sub.close(linger=0)
        context.destroy(linger=0)
