"""Waiting timeout, slot queueing, disconnects, wrong bootstrap injection."""

from __future__ import annotations

import httpx2
import orjson
import trio

from .helpers import eventually, new_room, pd_body, sse_events, start_engine


async def raw_request(engine, path: str, body: dict) -> trio.SocketStream:
    """Send a request over a raw socket (so the test decides exactly when it closes)."""
    stream = await trio.open_tcp_stream("127.0.0.1", engine.port)
    data = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode()
    await stream.send_all(head + data)
    return stream


async def test_waiting_timeout_frees_slot(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", waiting_timeout=0.5)
    room = new_room()
    start = trio.current_time()
    d = await client.post(decode.url + "/generate", json=pd_body(prefill, room, text="a"))
    assert 0.4 < trio.current_time() - start < 3.0
    assert d.status_code == 500
    assert "timed out" in d.json()["error"]["message"]
    assert decode.events.find("kv_wait_timeout", room=room)
    assert decode.events.find("slot_freed", room=room)[0]["reason"] == "kv_wait_timeout"
    assert decode.running == 0
    # streaming: 200 headers at once, the timeout arrives in-band
    room = new_room()
    body = pd_body(prefill, room, text="a", stream=True)
    d = await client.post(decode.url + "/generate", json=body)
    assert d.status_code == 200
    events = sse_events(d.text)
    assert events[0]["error"]["code"] == 500 and events[-1] == "[DONE]"
    assert decode.events.find("slot_freed", room=room, reason="kv_wait_timeout")


async def test_slot_queueing_fifo(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", max_running=1)
    room_a, room_b = new_room(), new_room()
    results = {}

    async def post(name, engine, room):
        body = pd_body(prefill, room, text="a b", sampling_params={"max_new_tokens": 2})
        results[name] = await client.post(engine.url + "/generate", json=body)

    async with trio.open_nursery() as inner:
        inner.start_soon(post, "da", decode, room_a)
        await decode.events.wait_for("slot_acquired", room=room_a)
        inner.start_soon(post, "db", decode, room_b)
        await decode.events.wait_for("room_registered", room=room_b)
        await trio.testing.wait_all_tasks_blocked()
        assert decode.running == 1 and decode.queued == 1
        assert not decode.events.find("slot_acquired", room=room_b)
        (load,) = (await client.get(decode.url + "/v1/loads")).json()["loads"]
        assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 2
        assert load["disaggregation"]["decode_prealloc_queue_reqs"] == 1
        inner.start_soon(post, "pa", prefill, room_a)
        got_b = await decode.events.wait_for("slot_acquired", room=room_b)
        freed_a = decode.events.find("slot_freed", room=room_a)[0]
        assert freed_a["reason"] == "finished" and freed_a["t"] <= got_b["t"]
        inner.start_soon(post, "pb", prefill, room_b)
    assert all(r.status_code == 200 for r in results.values())
    assert decode.running == 0 and decode.queued == 0


async def test_disconnect_frees_slot_at_next_poll_tick(nursery):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", disconnect_poll_secs=1.0)
    room = new_room()
    stream = await raw_request(decode, "/generate", pd_body(prefill, room, text="a"))
    await decode.events.wait_for("slot_acquired", room=room)
    # close just after a tick, so the abort must wait for most of an interval
    await trio.sleep_until(decode.state.ticker.next_tick() + 0.1)
    await stream.aclose()
    closed = await decode.events.wait_for("connection_closed", room=room, timeout=0.5)
    assert decode.running == 1  # still held: SGLang only notices at its next poll
    freed = await decode.events.wait_for("slot_freed", room=room, timeout=3)
    assert freed["reason"] == "aborted_disconnect"
    assert 0.5 < freed["t"] - closed["t"] < 1.5
    assert decode.running == 0
    end = await decode.events.wait_for("request_end", room=room)
    assert end["ended"] == "aborted_disconnect"
    # the abort also dropped the bootstrap registration
    await eventually(lambda: room not in prefill.rooms)


async def test_disconnect_while_queued_and_prefill_stops_at_once(nursery):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", max_running=1, disconnect_poll_secs=0.2)
    first, second = new_room(), new_room()
    s1 = await raw_request(decode, "/generate", pd_body(prefill, first, text="a"))
    await decode.events.wait_for("slot_acquired", room=first)
    s2 = await raw_request(decode, "/generate", pd_body(prefill, second, text="a"))
    await decode.events.wait_for("room_registered", room=second)
    await s2.aclose()
    await decode.events.wait_for("request_end", room=second, timeout=2)
    assert decode.queued == 0 and not decode.events.find("slot_acquired", room=second)
    # prefill: a client leaving while prefill waits for the registration stops it at once
    lonely = new_room()
    s3 = await raw_request(prefill, "/generate", pd_body(prefill, lonely, text="a"))
    await prefill.events.wait_for("request_start", room=lonely)
    await s3.aclose()
    closed = await prefill.events.wait_for("connection_closed", room=lonely, timeout=1)
    end = await prefill.events.wait_for("request_end", room=lonely, timeout=1)
    assert end["t"] - closed["t"] < 0.5 and end["ended"] == "aborted_disconnect"
    assert lonely not in prefill.rooms
    await s1.aclose()


async def test_wrong_bootstrap_port_fails_visibly(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    body = pd_body(prefill, new_room(), text="a")
    body["bootstrap_port"] = decode.port + 0  # a live port, but not a bootstrap server
    d = await client.post(decode.url + "/generate", json=body)
    assert d.status_code == 500 and "bootstrap" in d.json()["error"]["message"]
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    body["bootstrap_port"] = listener.getsockname()[1]  # bound, not listening: refused
    d = await client.post(decode.url + "/generate", json={**body, "stream": True})
    listener.close()
    assert d.status_code == 200
    assert sse_events(d.text)[0]["error"]["code"] == 500
    assert len(decode.events.find("bootstrap_failed")) == 2
    assert not decode.events.find("slot_acquired")


async def test_missing_bootstrap_fields_are_400(pair, client):
    prefill, decode = pair
    for engine in (prefill, decode):
        r = await client.post(engine.url + "/generate", json={"text": "a"})
        assert r.status_code == 400 and "bootstrap_room" in r.json()["error"]["message"]
    r = await client.post(decode.url + "/generate", json={"text": "a", "bootstrap_room": 5})
    assert r.status_code == 400
    r = await client.post(
        decode.url + "/generate", json=pd_body(prefill, [1, 2], text=["a", "b", "c"])
    )
    assert r.status_code == 400


async def test_prefill_bootstrap_timeout(nursery, client):
    prefill = await start_engine(nursery, "prefill", bootstrap_timeout=0.3)
    room = new_room()
    p = await client.post(prefill.url + "/generate", json=pd_body(prefill, room, text="a"))
    assert p.status_code == 500 and "bootstrap timeout" in p.json()["error"]["message"]
    assert prefill.events.find("bootstrap_timeout", room=room)


async def test_open_connections_tracks_client_connections(pair):
    _, decode = pair
    assert decode.open_connections == 0
    async with httpx2.AsyncClient(trust_env=False) as c:
        assert (await c.get(decode.url + "/health")).status_code == 200
        assert decode.open_connections == 1  # kept alive by the client pool
    await decode.wait_open_connections(0, timeout=2)
    assert decode.total_connections == 1
