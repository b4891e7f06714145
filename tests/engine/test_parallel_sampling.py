"""Rids and parallel sampling as SGLang normalizes them (io_struct.py): a rid list has one entry
per PROMPT (not per sample); n multiplies each prompt inside the engine, whose samples run under
regenerated rids and share the prompt's room, so in PD one sample waits for a KV that never
comes (measured on SGLang 0.5.23 with n = 2: the prefill answers both, the decode hangs), until
the waiting timeout."""

from __future__ import annotations

from .helpers import new_room, pd_body, pd_post, sse_events, start_engine

CHAT = [{"role": "user", "content": "hello there"}]


async def test_a_rid_list_has_one_entry_per_prompt(pair, client):
    prefill, decode = pair
    for engine in (prefill, decode):
        body = pd_body(prefill, new_room(), messages=CHAT, n=2, rid=["c0", "c1"])
        r = await client.post(engine.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["type"] == "BadRequestError"
        assert r.json()["message"] == (
            "The specified rids length mismatch with the batch_size for batch processing."
        )
        assert not engine.events.find("dispatched")
    # two prompts, two samples each: two rids
    body = pd_body(prefill, [new_room(), new_room()], text=["a", "b"], rid=["r0", "r1"])
    body["sampling_params"] = {"n": 2, "max_new_tokens": 1}
    body["bootstrap_host"] = "2.2.2.2"  # SGLang's fake transfer: no peer needed
    r = await client.post(prefill.url + "/generate", json=body)
    assert r.status_code == 200 and len(r.json()) == 4


async def test_pd_n_greater_than_one_hangs_one_sample_until_the_waiting_timeout(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", waiting_timeout=0.5)
    room = new_room()
    body = pd_body(prefill, room, messages=CHAT, n=2, rid="c", max_tokens=2)
    p, d = await pd_post(client, prefill, decode, "/v1/chat/completions", body)
    assert p.status_code == 200 and [c["index"] for c in p.json()["choices"]] == [0, 1]
    assert d.status_code == 500 and "KVPoll.WaitingForInput" in d.json()["message"]
    start = decode.events.find("request_start", room=room)[0]
    assert start["sglang_rids"] == ["c_0", "c_1"] and start["n"] == 2  # what it registered
    acquired = decode.events.find("slot_acquired", room=room)
    assert len(acquired) == 2  # two samples on one room
    samples = {e["sglang_rid"] for e in acquired}
    assert not samples & {"c", "c_0", "c_1"} and all(len(s) == 32 for s in samples)
    assert len(decode.events.find("kv_ready", room=room)) == 1
    assert len(decode.events.find("kv_wait_timeout", room=room)) == 1
    assert len(prefill.events.find("kv_sent", room=room)) == 1


async def test_the_clients_rid_cannot_abort_the_samples(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", waiting_timeout=0.5)
    room = new_room()
    body = pd_body(prefill, room, text="a", rid="g", sampling_params={"n": 2})
    async with client.stream("POST", decode.url + "/generate", json={**body, "stream": True}):
        await decode.events.wait_for("slot_acquired", room=room)
        for rid in ("g", "g_0", "g_1"):
            await client.post(decode.url + "/abort_request", json={"rid": rid})
    dropped = [e["dropped"] for e in decode.events.find("abort_request", source="http")]
    assert dropped == ["unregistered"] * 3


async def test_a_generate_stream_carries_the_hung_sample_as_an_abort_event(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", waiting_timeout=0.5)
    room = new_room()
    params = {"n": 2, "max_new_tokens": 2}
    body = pd_body(prefill, room, text="a", stream=True, sampling_params=params)
    _, d = await pd_post(client, prefill, decode, "/generate", body)
    events = sse_events(d.text)
    assert d.status_code == 200 and events[-1] == "[DONE]"
    ok = [e for e in events[:-1] if e["index"] == 0]
    assert [e["text"] for e in ok] == ["tok1", "tok1 tok2"]
    (hung,) = [e for e in events[:-1] if e["index"] == 1]
    assert hung["meta_info"]["finish_reason"]["status_code"] == 500


async def test_a_batch_with_samples_gives_each_prompt_its_room(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", waiting_timeout=0.5)
    rooms = [new_room(), new_room()]
    body = pd_body(prefill, rooms, prompt=["a", "b c"], n=2, max_tokens=1)
    p, d = await pd_post(client, prefill, decode, "/v1/completions", body)
    assert p.status_code == 200 and len(p.json()["choices"]) == 4
    assert d.status_code == 500
    for room in rooms:  # samples 0, 1 on the first room, 2, 3 on the second
        assert len(decode.events.find("slot_acquired", room=room)) == 2
        assert len(decode.events.find("kv_ready", room=room)) == 1
    # the first hung sample to time out fails the request; the other is aborted with it
    assert len(decode.events.find("kv_wait_timeout")) == 1
    assert len(decode.events.find("engine_abort", source="cleanup", matched=True)) == 1
    # a scalar room expands to room + i per prompt
    room = new_room()
    body = pd_body(prefill, room, text=["a", "b"], sampling_params={"max_new_tokens": 1})
    p, d = await pd_post(client, prefill, decode, "/generate", body)
    assert p.status_code == d.status_code == 200
    assert decode.events.find("kv_ready", room=room) and decode.events.find(
        "kv_ready", room=room + 1
    )
