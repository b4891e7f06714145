"""Waiting timeout, slot queueing, wrong bootstrap injection, the prefill's bootstrap timeout."""

from __future__ import annotations

import httpx2
import trio

from .helpers import new_room, pd_body, sse_events, start_engine


async def test_waiting_timeout_frees_slot(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", waiting_timeout=0.5)
    room = new_room()
    start = trio.current_time()
    d = await client.post(decode.url + "/generate", json=pd_body(prefill, room, text="a"))
    assert trio.current_time() - start > 0.4  # the waiting timeout ended it
    assert d.status_code == 500
    message = d.json()["message"]
    assert message.startswith("Decode transfer failed for request rank=0")
    assert f"Request {room} timed out after 0.5s in KVPoll.WaitingForInput" in message
    assert decode.events.find("kv_wait_timeout", room=room)
    # the request left at once; its KV pages wait for the prefill's ACK of the abort
    assert decode.events.find("kv_release_deferred", room=room, reason="kv_wait_timeout")
    freed = await decode.events.wait_for("slot_freed", room=room)
    assert freed["reason"] == "kv_wait_timeout" and freed["deferred"] and freed["acked"]
    assert prefill.events.find("abort_notified", room=room, active=False)
    assert decode.running == 0
    # streaming: 200 headers at once, the timeout arrives in-band as an abort with a status
    room = new_room()
    body = pd_body(prefill, room, text="a", stream=True)
    d = await client.post(decode.url + "/generate", json=body)
    assert d.status_code == 200
    events = sse_events(d.text)
    finish = events[0]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] == 500 and events[-1] == "[DONE]"
    await decode.events.wait_for("slot_freed", room=room, reason="kv_wait_timeout")


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


async def test_wrong_bootstrap_port_fails_visibly(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    # SGLang retries an unreachable bootstrap server 15 times a second apart: 3 x 0.2 s here
    decode = await start_engine(
        nursery, "decode", bootstrap_retries=3, bootstrap_retry_interval=0.2
    )
    body = pd_body(prefill, new_room(), text="a")
    body["bootstrap_port"] = decode.port + 0  # a live port, but not a bootstrap server: 404
    d = await client.post(decode.url + "/generate", json=body)
    assert d.status_code == 500 and "answered 404" in d.json()["message"]
    assert d.json()["message"].startswith("Decode handshake failed")
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    body["bootstrap_port"] = listener.getsockname()[1]  # bound, not listening: refused
    start = trio.current_time()
    d = await client.post(decode.url + "/generate", json={**body, "stream": True})
    listener.close()
    assert trio.current_time() - start > 0.35  # retried before giving up
    assert d.status_code == 200
    finish = sse_events(d.text)[0]["meta_info"]["finish_reason"]
    assert finish["status_code"] == 500 and "Aborted by AbortReq." in finish["message"]
    assert len(decode.events.find("bootstrap_failed")) == 2
    assert not decode.events.find("slot_acquired")


async def test_missing_bootstrap_fields_are_400(pair, client):
    prefill, decode = pair
    for engine in (prefill, decode):
        r = await client.post(engine.url + "/generate", json={"text": "a"})
        assert r.status_code == 400 and "bootstrap_room" in r.json()["error"]["message"]
        assert not engine.events.find("dispatched")
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
    assert p.status_code == 500
    assert p.json()["message"].startswith("Prefill bootstrap failed for request rank=0")
    assert f"Request {room} timed out after 0.3s in KVPoll.Bootstrapping" in p.json()["message"]
    assert prefill.events.find("bootstrap_timeout", room=room)


def test_the_bootstrap_timeout_is_sglangs_by_default():
    from trio_pd_testing.engine import EngineConfig

    assert EngineConfig(role="prefill").bootstrap_timeout == 300.0
    assert EngineConfig(role="decode").waiting_timeout == 300.0


async def test_open_connections_tracks_client_connections(pair):
    _, decode = pair
    assert decode.open_connections == 0
    async with httpx2.AsyncClient(trust_env=False) as c:
        assert (await c.get(decode.url + "/health")).status_code == 200
        assert decode.open_connections == 1  # kept alive by the client pool
    await decode.wait_open_connections(0, timeout=2)
    assert decode.total_connections == 1


async def test_the_waiting_timeout_counts_from_the_slot(nursery, client):
    """SGLang's waiting timeout starts when the decode publishes its KV metadata (after the
    preallocation), not when the request arrived: a request queued for a slot waits longer."""
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", max_running=1, waiting_timeout=0.5)
    first, second = new_room(), new_room()
    async with trio.open_nursery() as inner:
        results = {}

        async def post(name, room):
            body = pd_body(prefill, room, text="a")
            results[name] = await client.post(decode.url + "/generate", json=body)

        inner.start_soon(post, "first", first)
        await decode.events.wait_for("slot_acquired", room=first)
        inner.start_soon(post, "second", second)
        arrived = await decode.events.wait_for("room_registered", room=second)
    timed_out = decode.events.find("kv_wait_timeout", room=second)[0]
    acquired = decode.events.find("slot_acquired", room=second)[0]
    assert acquired["t"] - arrived["t"] > 0.3  # it queued behind the first one's timeout
    assert timed_out["t"] - acquired["t"] > 0.45  # the timeout counts from the slot
    assert timed_out["waited"] == 0.5
    assert timed_out["t"] - arrived["t"] > 0.8
