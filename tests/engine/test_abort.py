"""POST /abort_request as SGLang 0.5.23 handles it: what each queue does with an abort, the
scheduler's prefix match, the tokenizer manager's drop rules, abort_all, AbortReq validation."""

from __future__ import annotations

import time
from typing import Any

import httpx2
import trio

from trio_pd_testing.engine import EngineHandle

from .helpers import Background, eventually, new_room, pd_body, pd_post, sse_events, start_engine


async def abort(client: httpx2.AsyncClient, engine: EngineHandle, body: dict[str, Any]) -> None:
    r = await client.post(engine.url + "/abort_request", json=body)
    assert r.status_code == 200 and r.content == b""  # 200, empty, matched or not


async def used_tokens(client: httpx2.AsyncClient, engine: EngineHandle) -> int:
    return (await client.get(engine.url + "/v1/loads")).json()["loads"][0]["num_used_tokens"]


async def test_abort_in_the_transfer_queue_answers_at_once_and_holds_kv_until_the_ack(
    nursery, client
):
    prefill = await start_engine(nursery, "prefill")
    # the disconnect poll would take up to 4 s: an abort must not wait for it
    decode = await start_engine(nursery, "decode", disconnect_poll_secs=4.0, waiting_timeout=30)
    room = new_room()
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, pd_body(prefill, room, text="a b c", rid="sg-1"), rid="hdr-1")
        await decode.events.wait_for("slot_acquired", room=room)
        assert decode.running == 1
        asked = time.monotonic()
        await abort(client, decode, {"rid": "sg-1"})
        end = await decode.events.wait_for("request_end", room=room, timeout=1)
    assert end["t"] - asked < 1.0 and end["ended"] == "aborted_request"
    d = bg.results["d"]
    assert d.status_code == 500  # what SGLang answers an aborted KV transfer
    message = d.json()["message"]
    assert message.startswith("Decode transfer failed for request rank=0 decode_req.req.rid='sg-1'")
    assert message.endswith("Aborted by AbortReq.") and d.json()["type"] == "500"
    event = decode.events.find("abort_request", sglang_rid="sg-1")[0]
    assert event["matched"] is True and event["rid"] == "hdr-1" and event["room"] == room
    # its KV pages stay held until the prefill acknowledged the ABORT notification
    assert decode.events.find("kv_release_deferred", room=room, reason="aborted_request")
    freed = await decode.events.wait_for("slot_freed", room=room, timeout=2)
    assert freed["reason"] == "aborted_request" and freed["deferred"] and freed["acked"]
    assert prefill.events.find("abort_notified", room=room)
    assert decode.running == 0
    await eventually(lambda: room not in prefill.rooms)  # the registration was dropped too
    # the rid is free again once its request ended; a stream gets the abort in-band
    body = pd_body(prefill, new_room(), text="a", rid="sg-1", stream=True)
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, body, rid="hdr-2")
        await decode.events.wait_for("slot_acquired", rid="hdr-2")
        await abort(client, decode, {"rid": "sg-1"})
    events = sse_events(bg.results["d"].text)
    assert bg.results["d"].status_code == 200 and events[-1] == "[DONE]" and len(events) == 2
    finish = events[0]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] == 500
    assert events[0]["meta_info"]["id"] == "sg-1"


async def test_held_kv_shows_in_loads_until_the_prefill_drains(nursery, client):
    """The ACK waits while the prefill still computes (writes) the room; then its request
    fails too (the decode's ABORT marked the room failed)."""
    prefill = await start_engine(nursery, "prefill", prefill_ms_per_token=300.0)
    decode = await start_engine(nursery, "decode")
    room = new_room()
    body = pd_body(prefill, room, text="one two three", rid="slow")
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("p", prefill, body, rid="h")
        bg.post("d", decode, body, rid="h")
        await prefill.events.wait_for("room_registered", room=room)
        await decode.events.wait_for("slot_acquired", room=room)
        await trio.sleep(0.1)  # the prefill computes for 0.9 s
        await abort(client, decode, {"rid": "slow"})
        await decode.events.wait_for("request_end", room=room)
        (load,) = (await client.get(decode.url + "/v1/loads")).json()["loads"]
        assert load["num_waiting_reqs"] == load["num_running_reqs"] == 0  # it left ...
        assert load["num_used_tokens"] == 3  # ... its KV pages did not
        freed = await decode.events.wait_for("slot_freed", room=room, timeout=3)
    kv_sent = prefill.events.find("kv_sent", room=room)
    assert not kv_sent and freed["acked"] is True
    notified = prefill.events.find("abort_notified", room=room)[0]
    assert notified["active"] is True and freed["t"] - notified["t"] > 0.5  # after the drain
    assert await used_tokens(client, decode) == 0
    p = bg.results["p"]
    assert p.status_code == 500 and p.json()["message"].startswith("Prefill transfer failed")
    assert "Failed due to an unknown reason from another rank" in p.json()["message"]


async def test_without_an_ack_the_kv_is_held_for_the_release_timeout(nursery, client):
    prefill_scope = trio.CancelScope()
    handle: dict[str, EngineHandle] = {}

    async def run_prefill(task_status=trio.TASK_STATUS_IGNORED):
        with prefill_scope:
            handle["p"] = await start_engine(inner_nursery, "prefill")
            task_status.started()
            await trio.sleep_forever()

    decode = await start_engine(
        nursery, "decode", deferred_kv_release_timeout=1.0, heartbeat_interval=30
    )
    room = new_room()
    async with trio.open_nursery() as inner_nursery:
        await inner_nursery.start(run_prefill)
        prefill = handle["p"]
        bg = Background(inner_nursery, client)
        bg.post("d", decode, pd_body(prefill, room, text="a b", rid="orphan"), rid="h")
        await decode.events.wait_for("slot_acquired", room=room)
        inner_nursery.cancel_scope.cancel()  # the prefill engine dies (its bootstrap too)
    await abort(client, decode, {"rid": "orphan"})
    deferred = await decode.events.wait_for("kv_release_deferred", room=room)
    assert await used_tokens(client, decode) == 2
    freed = await decode.events.wait_for("slot_freed", room=room, timeout=30)
    assert freed["acked"] is False and freed["t"] - deferred["t"] > 0.9  # the 1 s release timeout
    assert await used_tokens(client, decode) == 0


async def test_abort_while_queued_leaves_at_once_and_openai_shapes(nursery, client):
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
        assert not decode.events.find("kv_release_deferred", room=second)  # no KV held yet
        await abort(client, decode, {"rid": "one"})
    second_answer = bg.results["second"]
    assert second_answer.status_code == 500 and "meta_info" not in second_answer.json()
    assert second_answer.json()["message"].startswith("Decode handshake failed")
    assert bg.results["first"].status_code == 500
    await eventually(lambda: decode.running == 0)


async def test_abort_of_a_running_request_finishes_after_one_more_token(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", inter_token_ms=100.0)
    for path, extra in (
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 50}}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "max_tokens": 50},
        ),
    ):
        room = new_room()
        body = pd_body(prefill, room, rid=f"run-{path}", stream=True, **extra)
        async with trio.open_nursery() as inner:
            bg = Background(inner, client)
            bg.post("d", decode, body, rid="h", path=path)
            bg.post("p", prefill, body, rid="h", path=path)
            await decode.events.wait_for("first_token", room=room)
            await trio.sleep(0.25)
            await abort(client, decode, {"rid": f"run-{path}"})
        events = sse_events(bg.results["d"].text)
        assert bg.results["d"].status_code == 200 and events[-1] == "[DONE]"
        if path == "/generate":
            last = events[-2]
            finish = last["meta_info"]["finish_reason"]
            assert finish == {"type": "abort", "message": "Aborted", "status_code": None,
                              "err_type": None}  # fmt: skip
            assert 3 <= last["meta_info"]["completion_tokens"] <= 5
        else:  # OpenAI: no meta_info, only the choice's finish_reason says it
            reasons = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]]
            assert reasons[-1] == "abort" and all(r is None for r in reasons[:-1])
            assert all("meta_info" not in c for c in events[:-1])
        freed = await decode.events.wait_for("slot_freed", room=room)
        assert freed["reason"] == "aborted_request" and "deferred" not in freed


async def test_abort_stops_a_prefill_waiting_for_its_decode(nursery, client):
    prefill = await start_engine(nursery, "prefill")  # bootstrap timeout 300 s: it would wait
    room = new_room()
    with trio.fail_after(5):
        async with trio.open_nursery() as inner:
            bg = Background(inner, client)
            body = pd_body(prefill, room, text="a", rid="p-1", stream=True)
            bg.post("p", prefill, body, rid="hp")
            await prefill.events.wait_for("dispatched", room=room)
            await eventually(lambda: room in prefill.rooms)
            await abort(client, prefill, {"rid": "p-1"})
    events = sse_events(bg.results["p"].text)
    finish = events[0]["meta_info"]["finish_reason"]
    assert finish["status_code"] == 500 and events[-1] == "[DONE]"
    assert finish["message"].startswith("Prefill bootstrap failed for request rank=0")
    end = await prefill.events.wait_for("request_end", room=room)
    assert end["ended"] == "aborted_request"
    assert room not in prefill.rooms
    assert prefill.events.find("abort_request", sglang_rid="p-1", matched=True, rid="hp")


async def test_the_scheduler_aborts_by_prefix(nursery, client):
    """`req.rid.startswith(abort.rid)`: aborting X aborts X-retry1; X_1 aborts X_10."""
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    rooms = {rid: new_room() for rid in ("X", "X-retry1", "Y_1", "Y_10", "Y_2")}
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        for rid, room in rooms.items():
            bg.post(rid, decode, pd_body(prefill, room, text="a", rid=rid), rid=f"h-{rid}")
        for room in rooms.values():
            await decode.events.wait_for("slot_acquired", room=room)
        await abort(client, decode, {"rid": "X"})
        await abort(client, decode, {"rid": "Y_1"})
        for rid in ("X", "X-retry1", "Y_1", "Y_10"):
            await decode.events.wait_for("request_end", room=rooms[rid], timeout=2)
        assert not decode.events.find("request_end", room=rooms["Y_2"])
        await abort(client, decode, {"rid": "Y_2"})
    hits = {e["aborted_rid"]: e["sglang_rid"] for e in decode.events.find("abort_request")}
    assert hits == {"X": "X", "X-retry1": "X", "Y_1": "Y_1", "Y_10": "Y_1", "Y_2": "Y_2"}
    assert all(bg.results[rid].status_code == 500 for rid in rooms)


async def test_an_unregistered_rid_is_dropped_by_the_tokenizer_manager(nursery, client):
    """The prefix match happens in the scheduler, but the tokenizer manager forwards only aborts
    of rids it registered (tokenizer_worker_num == 1): aborting X with only X-retry1 live
    does nothing; with several tokenizer workers it is forwarded, and matches."""
    prefill = await start_engine(nursery, "prefill")
    for workers, reaches in ((1, False), (2, True)):
        decode = await start_engine(nursery, "decode", tokenizer_worker_num=workers)
        room = new_room()
        async with trio.open_nursery() as inner:
            bg = Background(inner, client)
            bg.post("d", decode, pd_body(prefill, room, text="a", rid="X-retry1"), rid="h")
            await decode.events.wait_for("slot_acquired", room=room)
            await abort(client, decode, {"rid": "X"})
            event = await decode.events.wait_for("abort_request", sglang_rid="X")
            assert event["matched"] is reaches
            if reaches:  # matched: the slot is freed at the scheduler's next step
                await decode.events.wait_for("slot_freed", room=room)
            assert bool(decode.events.find("slot_freed", room=room)) is reaches
            if not reaches:
                assert event["dropped"] == "unregistered"
                await abort(client, decode, {"rid": "X-retry1"})


async def test_abort_of_unknown_rid_is_200_and_changes_nothing(pair, client):
    prefill, decode = pair
    room = new_room()
    body = pd_body(prefill, room, text="a b", rid="known")
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, body, rid="h")
        await decode.events.wait_for("slot_acquired", room=room)
        await abort(client, decode, {"rid": "unknown"})
        await abort(client, decode, {})  # nothing named: SGLang's empty AbortReq, ignored
        await abort(client, decode, {"rid": "", "abort_message": "why"})
        await abort(client, prefill, {"rid": "known"})  # held by the decode, not the prefill
        await trio.sleep(0.1)
        assert decode.running == 1 and not decode.events.find("slot_freed", room=room)
        bg.post("p", prefill, body, rid="h")
    assert bg.results["d"].status_code == bg.results["p"].status_code == 200
    assert bg.results["d"].json()["meta_info"]["finish_reason"]["type"] == "length"
    missed = decode.events.find("abort_request", sglang_rid="unknown")[0]
    assert missed["matched"] is False and missed["rid"] is None
    assert missed["dropped"] == "unregistered"
    assert len(decode.events.find("abort_request", dropped="empty")) == 2
    assert prefill.events.find("abort_request", sglang_rid="known", matched=False)


async def test_abort_request_validation(pair, client):
    """AbortReq's schema (FastAPI): rid a string, abort_all a bool; a list rid is a 400."""
    _, decode = pair
    for bad in ({"rid": ["a", "b"]}, {"rid": 5}, {"abort_all": "maybe"}, [1]):
        r = await client.post(decode.url + "/abort_request", json=bad)
        assert r.status_code == 400 and r.json()["object"] == "error", bad
        assert r.json()["type"] == "Bad Request"
    r = await client.post(decode.url + "/abort_request", json={"rid": ["a"]})
    assert "Input should be a valid string" in r.json()["message"]
    r = await client.post(decode.url + "/abort_request", content=b"")
    assert r.status_code == 400
    assert (await client.get(decode.url + "/abort_request")).status_code == 405
    assert not decode.events.find("abort_request")
    await abort(client, decode, {"abort_all": "yes"})  # pydantic's lax bool
    assert decode.events.find("abort_request", abort_all=True, matched=False)


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
        assert bg.results[f"d{i}"].status_code == 500
        freed = await decode.events.wait_for("slot_freed", room=room)
        assert freed["reason"] == "aborted_request"
        assert decode.events.find("abort_request", rid=f"h{i}", matched=True, abort_all=True)
    assert decode.running == 0
    await abort(client, decode, {"abort_all": True})
    assert decode.events.find("abort_request", matched=False, abort_all=True)


async def test_duplicate_rid_is_refused_as_the_engine_shapes_it(pair, client):
    prefill, decode = pair
    room, dup_room = new_room(), new_room()
    body = pd_body(prefill, room, text="a", rid="dup")
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, body, rid="h1")
        await decode.events.wait_for("slot_acquired", room=room)
        again = pd_body(prefill, dup_room, text="a", rid="dup")
        r = await client.post(decode.url + "/generate", json=again, headers={"x-request-id": "h2"})
        assert r.status_code == 400
        assert r.json() == {"error": {"message": "Duplicate request ID detected: dup"}}
        # a /generate stream has sent its 200 before the engine looks: the refusal is in-band
        r = await client.post(decode.url + "/generate", json={**again, "stream": True})
        events = sse_events(r.text)
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert events[0]["error"] == {
            "message": "Duplicate request ID detected: dup",
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
        for path, extra in (
            ("/v1/completions", {"prompt": "a"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
        ):
            for stream in (False, True):
                fields = {**pd_body(prefill, dup_room, rid="dup", stream=stream), **extra}
                r = await client.post(decode.url + path, json=fields)
                assert r.status_code == 400, (path, stream)  # before an OpenAI stream's 1st chunk
                assert r.json()["type"] == "BadRequestError"
                assert r.json()["message"] == "Duplicate request ID detected: dup"
        end = await decode.events.wait_for("request_end", rid="h2")
        assert end["status"] == 400 and "Duplicate" in end["error"]
        assert not decode.events.find("room_registered", room=dup_room)
        assert decode.running == 1
        bg.post("p", prefill, body, rid="h1")
    assert bg.results["d"].status_code == 200 and bg.results["p"].status_code == 200
    assert decode.events.find("slot_freed", room=room)[0]["reason"] == "finished"


async def test_a_refused_duplicate_stream_aborts_the_original_two_seconds_later(pair, client):
    """SGLang's background abort (create_abort_task) of a /generate stream aborts its rids 2 s
    after the response, whoever holds them: a stream refused as a duplicate aborts the
    request it duplicated."""
    prefill, decode = pair
    room = new_room()
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, pd_body(prefill, room, text="a", rid="orig"), rid="h1")
        await decode.events.wait_for("slot_acquired", room=room)
        dup = pd_body(prefill, new_room(), text="a", rid="orig", stream=True)
        refused = await client.post(decode.url + "/generate", json=dup)
        assert "Duplicate" in sse_events(refused.text)[0]["error"]["message"]
        at = time.monotonic()
        event = await decode.events.wait_for("engine_abort", source="background", timeout=30)
    assert event["matched"] is True and event["rid"] == "h1"
    assert event["t"] - at > 1.5  # not at once: the background abort's delay
    assert bg.results["d"].status_code == 500


async def test_batch_rids_and_per_item_aborts(pair, client):
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
        assert r.status_code == 400 and "Duplicate request ID detected: b1" in r.text
        await abort(client, decode, {"rid": "b1"})  # one item: the others are then cleaned up
    assert bg.results["d"].status_code == 500  # an aborted transfer fails the whole batch
    first_abort = decode.events.find("abort_request", sglang_rid="b1")[0]
    assert first_abort["aborted_rid"] == "b1" and first_abort["source"] == "http"
    cleanup = decode.events.find("engine_abort", sglang_rid="b0")[0]
    assert cleanup["source"] == "cleanup"
    for room in rooms:
        await decode.events.wait_for("slot_freed", room=room)
    # a string rid on a batch names the items <rid>_<i>, as SGLang does
    rooms = [new_room(), new_room()]
    body = pd_body(prefill, rooms, input_ids=[[1], [2]], rid="s", sampling_params={})
    _, d = await pd_post(client, prefill, decode, "/generate", body)
    assert [item["meta_info"]["id"] for item in d.json()] == ["s_0", "s_1"]
    # a rid list must have one entry per PROMPT
    for bad in (["only-one"], ["a", "b", "c"]):
        body = pd_body(prefill, [new_room(), new_room()], text=["a", "b"], rid=bad)
        r = await client.post(decode.url + "/generate", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "The specified rids length mismatch with the batch_size for batch processing."
        )
    body = pd_body(prefill, [new_room(), new_room()], text=["a", "b"], rid=["same", "same"])
    r = await client.post(decode.url + "/generate", json=body)
    assert "Duplicate request IDs detected within the request: ['same']" in r.text
    r = await client.post(decode.url + "/generate", json={**body, "rid": 7})
    assert r.status_code == 400 and r.json()["type"] == "Bad Request"
    assert decode.running == 0
