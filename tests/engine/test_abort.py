"""POST /abort_request and body rids: immediate aborts, unknown rids, abort_all, duplicates."""

from __future__ import annotations

import time
from typing import Any

import httpx2
import trio

from trio_pd.testing.engine import EngineHandle

from .helpers import Background, eventually, new_room, pd_body, sse_events, start_engine


async def abort(client: httpx2.AsyncClient, engine: EngineHandle, body: dict[str, Any]) -> None:
    r = await client.post(engine.url + "/abort_request", json=body)
    assert r.status_code == 200


def is_abort(doc: dict[str, Any]) -> bool:
    return doc["meta_info"]["finish_reason"]["type"] == "abort"


async def test_abort_during_kv_wait_frees_the_slot_at_once(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    # the disconnect poll would take up to 4 s: an abort must not wait for it
    decode = await start_engine(nursery, "decode", disconnect_poll_secs=4.0, waiting_timeout=30)
    room = new_room()
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, pd_body(prefill, room, text="a", rid="sg-1"), rid="hdr-1")
        await decode.events.wait_for("slot_acquired", room=room)
        assert decode.running == 1
        asked = time.monotonic()
        await abort(client, decode, {"rid": "sg-1"})
        freed = await decode.events.wait_for("slot_freed", room=room, timeout=1)
    assert freed["reason"] == "aborted_request" and freed["t"] - asked < 1.0
    assert decode.running == 0
    event = decode.events.find("abort_request", sglang_rid="sg-1")[0]
    assert event["matched"] is True and event["rid"] == "hdr-1" and event["room"] == room
    d = bg.results["d"]
    assert d.status_code == 200 and is_abort(d.json())
    assert d.json()["meta_info"]["id"] == "sg-1"  # SGLang reports the body rid
    end = await decode.events.wait_for("request_end", room=room)
    assert end["ended"] == "aborted_request" and end["status"] == 200
    start = decode.events.find("request_start", room=room)[0]
    assert start["sglang_rid"] == "sg-1" and start["rid"] == "hdr-1"
    await eventually(lambda: room not in prefill.rooms)  # the registration was dropped too
    # the rid is free again once its request ended
    body = pd_body(prefill, new_room(), text="a", rid="sg-1", stream=True)
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, body, rid="hdr-2")
        await decode.events.wait_for("slot_acquired", rid="hdr-2")
        await abort(client, decode, {"rid": "sg-1"})
    events = sse_events(bg.results["d"].text)
    assert bg.results["d"].status_code == 200
    assert is_abort(events[0]) and events[-1] == "[DONE]" and len(events) == 2


async def test_abort_on_openai_route_and_while_queued(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", max_running=1, disconnect_poll_secs=4.0)
    first, second = new_room(), new_room()
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("first", decode, pd_body(prefill, first, text="a", rid="one"), rid="h1")
        await decode.events.wait_for("slot_acquired", room=first)

        async def completion() -> None:
            body = pd_body(prefill, second, prompt="a", rid="two")
            bg.results["second"] = await client.post(decode.url + "/v1/completions", json=body)

        inner.start_soon(completion)
        await decode.events.wait_for("room_registered", room=second)
        await eventually(lambda: decode.queued == 1)
        await abort(client, decode, {"rid": "two"})
        await decode.events.wait_for("request_end", room=second, timeout=1)
        assert decode.queued == 0 and decode.running == 1  # the first one is untouched
        assert not decode.events.find("slot_acquired", room=second)
        await abort(client, decode, {"rid": "one"})
    doc = bg.results["second"].json()
    assert doc["choices"][0]["finish_reason"] == "abort" and is_abort(doc)
    assert is_abort(bg.results["first"].json())
    assert decode.running == 0


async def test_abort_stops_a_prefill_request(nursery, client):
    prefill = await start_engine(nursery, "prefill")  # bootstrap timeout 30 s: it would wait
    room = new_room()
    with trio.fail_after(5):
        async with trio.open_nursery() as inner:
            bg = Background(inner, client)
            body = pd_body(prefill, room, text="a", rid="p-1", stream=True)
            bg.post("p", prefill, body, rid="hp")
            await prefill.events.wait_for("request_start", room=room)
            await eventually(lambda: room in prefill.rooms)
            await abort(client, prefill, {"rid": ["p-1"]})
    events = sse_events(bg.results["p"].text)
    assert is_abort(events[0]) and events[-1] == "[DONE]"
    end = await prefill.events.wait_for("request_end", room=room)
    assert end["ended"] == "aborted_request"
    assert room not in prefill.rooms
    assert prefill.events.find("abort_request", sglang_rid="p-1", matched=True, rid="hp")


async def test_abort_of_unknown_rid_is_200_and_changes_nothing(pair, client):
    prefill, decode = pair
    room = new_room()
    body = pd_body(prefill, room, text="a b", rid="known")
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, body, rid="h")
        await decode.events.wait_for("slot_acquired", room=room)
        await abort(client, decode, {"rid": "unknown"})
        await abort(client, decode, {})  # nothing named: SGLang's empty AbortReq
        await abort(client, prefill, {"rid": "known"})  # held by the decode, not the prefill
        await trio.sleep(0.1)
        assert decode.running == 1 and not decode.events.find("slot_freed", room=room)
        bg.post("p", prefill, body, rid="h")
    assert bg.results["d"].status_code == bg.results["p"].status_code == 200
    assert bg.results["d"].json()["meta_info"]["finish_reason"]["type"] == "length"
    missed = decode.events.find("abort_request", sglang_rid="unknown")[0]
    assert missed["matched"] is False and missed["rid"] is None
    assert prefill.events.find("abort_request", sglang_rid="known", matched=False)
    r = await client.post(decode.url + "/abort_request", json={"rid": 5})
    assert r.status_code == 400
    assert (await client.get(decode.url + "/abort_request")).status_code == 405


async def test_abort_all(pair, client):
    prefill, decode = pair
    rooms = [new_room(), new_room()]
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        for i, room in enumerate(rooms):
            bg.post(f"d{i}", decode, pd_body(prefill, room, text="a"), rid=f"h{i}")  # no body rid
        for room in rooms:
            await decode.events.wait_for("slot_acquired", room=room)
        await abort(client, decode, {"abort_all": True})
    for i, room in enumerate(rooms):
        assert is_abort(bg.results[f"d{i}"].json())
        assert decode.events.find("slot_freed", room=room)[0]["reason"] == "aborted_request"
        assert decode.events.find("abort_request", rid=f"h{i}", matched=True, abort_all=True)
    assert decode.running == 0
    await abort(client, decode, {"abort_all": True})
    assert decode.events.find("abort_request", matched=False, abort_all=True)


async def test_duplicate_rid_is_400_and_the_running_request_is_unaffected(pair, client):
    prefill, decode = pair
    room, dup_room = new_room(), new_room()
    body = pd_body(prefill, room, text="a", rid="dup")
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, body, rid="h1")
        await decode.events.wait_for("slot_acquired", room=room)
        again = pd_body(prefill, dup_room, text="a", rid="dup", stream=True)
        r = await client.post(decode.url + "/generate", json=again, headers={"x-request-id": "h2"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "Duplicate request ID: dup"
        assert r.json()["error"]["code"] == 400
        assert not decode.events.find("room_registered", room=dup_room)
        end = await decode.events.wait_for("request_end", rid="h2")
        assert end["status"] == 400 and "Duplicate" in end["error"]
        assert decode.running == 1
        bg.post("p", prefill, body, rid="h1")
    assert bg.results["d"].status_code == 200 and bg.results["p"].status_code == 200
    assert decode.events.find("slot_freed", room=room)[0]["reason"] == "finished"


async def test_batch_rid_lists(pair, client):
    prefill, decode = pair
    rooms = [new_room(), new_room()]
    body = pd_body(prefill, rooms, text=["a", "b"], rid=["b0", "b1"])
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, body, rid="hb")
        for room in rooms:
            await decode.events.wait_for("slot_acquired", room=room)
        single = pd_body(prefill, new_room(), text="x", rid="b1")
        r = await client.post(decode.url + "/generate", json=single)
        assert r.status_code == 400 and "Duplicate request ID: b1" in r.json()["error"]["message"]
        await abort(client, decode, {"rid": "b1"})  # one item's rid aborts the whole batch
    items = bg.results["d"].json()
    assert [item["meta_info"]["id"] for item in items] == ["b0", "b1"]
    assert all(is_abort(item) for item in items)
    for room in rooms:
        assert decode.events.find("slot_freed", room=room)[0]["reason"] == "aborted_request"
    # a string rid on a batch names the items <rid>_<i>, as SGLang does
    rooms = [new_room(), new_room()]
    body = pd_body(prefill, rooms, input_ids=[[1], [2]], rid="s", sampling_params={})
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, body, rid="hs")
        await decode.events.wait_for("slot_acquired", room=rooms[1])
        await abort(client, decode, {"rid": "s_1"})
    assert [item["meta_info"]["id"] for item in bg.results["d"].json()] == ["s_0", "s_1"]
    for bad in (["only-one"], ["same", "same"], 7):
        body = pd_body(prefill, [new_room(), new_room()], text=["a", "b"], rid=bad)
        r = await client.post(decode.url + "/generate", json=body)
        assert r.status_code == 400 and "rid" in r.json()["error"]["message"]
    assert decode.running == 0
