"""The abort latch (tokenizer_manager.py): an abort that lands after a request's registration but
before it reaches the scheduler matches nothing and is lost, and `abort_sent` then drops every
later abort of that rid, the engine's own disconnect abort included. The window is real with the
async dynamic batch tokenizer (or multimodal processing): tokenize_delay_ms opens it here."""

from __future__ import annotations

import trio

from .helpers import Background, new_room, pd_body, raw_request, start_engine


async def test_an_abort_in_the_tokenize_window_is_lost_and_latches(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(
        nursery,
        "decode",
        enable_dynamic_batch_tokenizer=True,
        tokenize_delay_ms=300.0,
        waiting_timeout=1.5,
        disconnect_poll_secs=0.3,
    )
    info = (await client.get(decode.url + "/server_info")).json()
    assert info["enable_dynamic_batch_tokenizer"] is True
    assert 0.3 < info["simulator"]["tokenize_window"] < 0.31  # 2 ms batch timeout + 300 ms
    room = new_room()
    stream = await raw_request(decode, "/generate", pd_body(prefill, room, text="a b", rid="L"))
    await decode.events.wait_for("request_start", room=room)
    r = await client.post(decode.url + "/abort_request", json={"rid": "L"})
    assert r.status_code == 200  # answered as if it worked
    lost = decode.events.find("abort_request", sglang_rid="L")[0]
    assert (lost["matched"], lost["dropped"]) == (False, "not_dispatched")
    acquired = await decode.events.wait_for("slot_acquired", room=room)
    assert acquired["t"] > lost["t"]  # the request went on regardless
    await client.post(decode.url + "/abort_request", json={"rid": "L"})
    latched = decode.events.find("abort_request", sglang_rid="L")[1]
    assert (latched["matched"], latched["dropped"]) == (False, "latched")
    await stream.aclose()  # the client leaves: the engine's own abort is dropped too
    own = await decode.events.wait_for("engine_abort", source="disconnect", timeout=2)
    assert (own["matched"], own["dropped"]) == (False, "latched")
    # the rid stays registered while the engine still works on it
    dup = await client.post(
        decode.url + "/generate", json=pd_body(prefill, new_room(), text="x", rid="L")
    )
    assert dup.status_code == 400 and "Duplicate request ID detected: L" in dup.text
    assert decode.running == 1  # nothing freed the slot: only the waiting timeout will
    freed = await decode.events.wait_for("slot_freed", room=room, timeout=4)
    assert freed["reason"] == "kv_wait_timeout" and freed["t"] - acquired["t"] > 1.4


async def test_no_window_without_tokenizing(nursery, client):
    """input_ids need no tokenizer: the request is at the scheduler before any abort can land;
    without the option a text prompt has no window either."""
    prefill = await start_engine(nursery, "prefill")
    slow = await start_engine(nursery, "decode", tokenize_delay_ms=300.0)
    plain = await start_engine(nursery, "decode")
    for engine, body in (
        (slow, pd_body(prefill, new_room(), input_ids=[1, 2], rid="ids")),
        (plain, pd_body(prefill, new_room(), text="a b", rid="text")),
    ):
        async with trio.open_nursery() as inner:
            bg = Background(inner, client)
            bg.post("d", engine, body, rid="h")
            await engine.events.wait_for("request_start", rid="h")
            await client.post(engine.url + "/abort_request", json={"rid": body["rid"]})
        assert engine.events.find("abort_request", sglang_rid=body["rid"])[0]["matched"] is True
        assert bg.results["d"].status_code == 500
