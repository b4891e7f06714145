"""Smaller PD facts of SGLang 0.5.23: room 0, the decode's heartbeat to its prefills, the fake
bootstrap host, /health (a 1-token generation) and /ready (cheap)."""

from __future__ import annotations

import trio

from trio_pd_testing.engine import EngineHandle

from .helpers import Background, new_room, pd_body, pd_post, start_engine


async def test_room_zero_is_never_committed(nursery, client):
    """disaggregation/utils.py: room 0 is the decode's "metadata not yet written" sentinel; a
    request that really uses it gets its KV and waits forever (no timeout applies) unless
    aborted."""
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", waiting_timeout=0.3)
    body = pd_body(prefill, 0, text="a b", rid="zero")
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, body, rid="h")
        bg.post("p", prefill, body, rid="h")
        await prefill.events.wait_for("kv_sent", room=0)
        await decode.events.wait_for("metadata_gate", room=0)
        await trio.sleep(0.6)  # twice the waiting timeout
        assert not decode.events.find("kv_ready", room=0)
        assert not decode.events.find("kv_wait_timeout", room=0)
        (load,) = (await client.get(decode.url + "/v1/loads")).json()["loads"]
        assert load["disaggregation"]["decode_transfer_queue_reqs"] == 1
        await client.post(decode.url + "/abort_request", json={"rid": "zero"})
    assert bg.results["p"].status_code == 200  # the prefill did its part
    assert bg.results["d"].status_code == 500
    await decode.events.wait_for("slot_freed", room=0)


async def test_the_heartbeat_fails_a_dead_prefills_rooms(nursery, client):
    """conn.py: /health on each known prefill bootstrap server every interval; after
    max_failures misses its unfinished rooms fail (SGLang: 5 s x 2, here 0.2 s x 2)."""
    decode = await start_engine(
        nursery,
        "decode",
        heartbeat_interval=0.2,
        heartbeat_max_failures=2,
        deferred_kv_release_timeout=0.5,
    )
    handle: dict[str, EngineHandle] = {}
    room = new_room()
    async with trio.open_nursery() as doomed:

        async def prefill_engine(task_status=trio.TASK_STATUS_IGNORED):
            handle["p"] = await start_engine(doomed, "prefill")
            task_status.started()

        await doomed.start(prefill_engine)
        prefill = handle["p"]
        # a finished request first: the decode knows the prefill and heartbeats it
        p, d = await pd_post(
            client, prefill, decode, "/generate", pd_body(prefill, new_room(), text="a")
        )
        assert p.status_code == d.status_code == 200
        bg = Background(nursery, client)
        bg.post("d", decode, pd_body(prefill, room, text="a"), rid="orphan")
        await decode.events.wait_for("slot_acquired", room=room)
        await trio.sleep(0.5)
        assert not decode.events.find("heartbeat_failed")  # alive: it answers
        doomed.cancel_scope.cancel()  # the prefill process dies
    died = trio.current_time()
    lost = await decode.events.wait_for("prefill_lost", timeout=3)
    # Noticed by the heartbeat (not at once), and long before anything else would end it.
    assert lost["rooms"] == [room] and 0.2 < trio.current_time() - died < 15.0
    assert len(decode.events.find("heartbeat_failed")) >= 2
    end = await decode.events.wait_for("request_end", room=room)
    assert end["status"] == 500
    freed = await decode.events.wait_for("slot_freed", room=room, timeout=30)
    assert freed["reason"] == "prefill_lost" and freed["acked"] is False  # nobody to ACK
    with trio.fail_after(30):
        while "d" not in bg.results:
            await trio.sleep(0.05)
    assert "Lost connection with prefill instance" in bg.results["d"].json()["message"]


async def test_the_fake_bootstrap_host_needs_no_peer(nursery, client):
    """SGLang's own health check runs a 1-token generation with bootstrap host 2.2.2.2 and room 0
    on each role: a fake transfer, no prefill or decode involved."""
    for role in ("prefill", "decode"):
        engine = await start_engine(nursery, role)
        body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1}}
        body.update(bootstrap_host="2.2.2.2", bootstrap_room=0)
        with trio.fail_after(30):  # a hang guard: a peer it needed would never answer
            r = await client.post(engine.url + "/generate", json=body)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1


async def test_health_generates_and_ready_is_cheap(nursery, client):
    decode = await start_engine(nursery, "decode", health_generate_secs=1.5)
    start = trio.current_time()
    assert (await client.get(decode.url + "/health")).status_code == 200
    assert (await client.get(decode.url + "/health_generate")).status_code == 200
    assert trio.current_time() - start >= 3.0  # two 1-token generations
    start = trio.current_time()
    r = await client.get(decode.url + "/ready")
    # Cheap: less than the one generation it would cost (a loaded machine's slowness cannot
    # make a loopback GET take 1.5 s).
    assert r.status_code == 200 and trio.current_time() - start < 1.5
    decode.state.health_status = 503  # still starting
    for path in ("/health", "/health_generate", "/ready"):
        assert (await client.get(decode.url + path)).status_code == 503
    decode.state.health_status = 200
    decode.state.stopping = True  # shutting down
    for path in ("/health", "/ready"):
        assert (await client.get(decode.url + path)).status_code == 503


async def test_an_abort_in_the_waiting_queue_is_graceful_and_at_once(nursery, client):
    """KV arrived, not yet running (the `slow` fault holds it there): scheduler.abort_request
    pops it from the waiting queue, the answer is 'Abort in waiting queue' without a status."""
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    room = new_room()
    body = pd_body(prefill, room, text="a", rid="w", sim_fault="decode:slow:60000")
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, body, rid="h")
        bg.post("p", prefill, body, rid="h")
        await decode.events.wait_for("kv_ready", room=room)
        (load,) = (await client.get(decode.url + "/v1/loads")).json()["loads"]
        assert load["queues"]["waiting"] == 1 and load["num_waiting_reqs"] == 1
        with trio.fail_after(30):  # the abort ends it, not the 60 s wait
            await client.post(decode.url + "/abort_request", json={"rid": "w"})
            await decode.events.wait_for("request_end", room=room)
    d = bg.results["d"]
    assert d.status_code == 200
    finish = d.json()["meta_info"]["finish_reason"]
    assert finish == {"type": "abort", "message": "Abort in waiting queue"}
    assert not decode.events.find("first_token", room=room)
    freed = decode.events.find("slot_freed", room=room)[0]
    assert freed["reason"] == "aborted_request" and "deferred" not in freed


async def test_a_prompt_longer_than_the_context_is_refused(nursery, client):
    prefill = await start_engine(nursery, "prefill", context_length=4)
    decode = await start_engine(nursery, "decode", waiting_timeout=0.3)
    body = pd_body(prefill, new_room(), text="one two three four five")
    p, d = await pd_post(client, prefill, decode, "/generate", body)
    assert p.status_code == 400
    assert p.json() == {
        "error": {
            "message": "The input (5 tokens) is longer than the model's context length (4 tokens)."
        }
    }
    assert d.status_code == 500  # its decode waits in vain (a router must abort it)
    assert not prefill.events.find("dispatched")
