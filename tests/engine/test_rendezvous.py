"""The normal PD path: rendezvous, response shapes, batches, logprobs."""

from __future__ import annotations

import trio

from .helpers import names, new_room, pd_body, pd_post, sse_events, start_engine


async def test_generate_rendezvous_and_event_order(pair, client):
    prefill, decode = pair
    room = new_room()
    body = pd_body(prefill, room, text="the quick brown fox", sampling_params={"max_new_tokens": 5})
    p, d = await pd_post(client, prefill, decode, "/generate", body)
    assert p.status_code == 200 and d.status_code == 200
    assert d.json()["text"] == "tok1 tok2 tok3 tok4 tok5"
    assert d.json()["output_ids"] and len(d.json()["output_ids"]) == 5
    meta = d.json()["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 5
    assert meta["cached_tokens"] == 0
    assert p.json()["meta_info"]["completion_tokens"] == 1  # prefill answers one token
    await decode.events.wait_for("request_end", room=room)
    order = [
        n
        for n in names(decode.events.find(room=room))
        if n in {"room_registered", "slot_acquired", "kv_ready", "first_token", "slot_freed"}
    ]
    assert order == ["room_registered", "slot_acquired", "kv_ready", "first_token", "slot_freed"]
    assert decode.events.find("slot_freed", room=room)[0]["reason"] == "finished"
    assert names(prefill.events.find(room=room))[:4] == [
        "request_start",
        "dispatched",
        "room_registered",
        "kv_sent",
    ]
    assert decode.running == 0 and decode.queued == 0


async def test_request_id_header_is_the_rid_and_echoed(pair, client):
    prefill, decode = pair
    room = new_room()
    body = pd_body(prefill, room, text="a b")
    results = {}

    async def post(name, engine):
        results[name] = await client.post(
            engine.url + "/generate", json=body, headers={"x-request-id": "req-42"}
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, "p", prefill)
        nursery.start_soon(post, "d", decode)
    assert results["d"].headers["x-request-id"] == "req-42"
    start = decode.events.find("request_start", rid="req-42")[0]
    # without a body rid the engine names the request itself (uuid4 hex), as SGLang does
    (engine_rid,) = start["sglang_rids"]
    assert results["d"].json()["meta_info"]["id"] == engine_rid != "req-42"
    assert len(engine_rid) == 32
    assert start["body"] == body and start["headers"]["x-request-id"] == "req-42"
    assert prefill.events.find("kv_sent", rid="req-42", room=room)


async def test_generate_stream(pair, client):
    prefill, decode = pair
    body = pd_body(
        prefill, new_room(), text="x y z", stream=True, sampling_params={"max_new_tokens": 3}
    )
    p, d = await pd_post(client, prefill, decode, "/generate", body)
    assert d.headers["content-type"] == "text/event-stream"
    events = sse_events(d.text)
    assert events[-1] == "[DONE]"
    assert [e["text"] for e in events[:-1]] == ["tok1", "tok1 tok2", "tok1 tok2 tok3"]
    assert events[-2]["output_ids"] == [50001, 50002, 50003]
    assert events[0]["meta_info"]["finish_reason"] is None
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"
    prefill_events = sse_events(p.text)
    assert (
        prefill_events[-1] == "[DONE]" and prefill_events[0]["meta_info"]["completion_tokens"] == 1
    )


async def test_stream_headers_sent_before_any_work(nursery, client):
    """Like SGLang, a streaming request gets 200 + SSE headers while it still waits for the KV."""
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    body = pd_body(prefill, new_room(), text="a", stream=True)
    with trio.fail_after(5):
        for engine in (prefill, decode):
            async with client.stream("POST", engine.url + "/generate", json=body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"] == "text/event-stream"
    assert not decode.events.find("kv_ready")  # nobody sent the KV, yet the headers came


async def test_openai_completions_and_chat_shapes(pair, client):
    prefill, decode = pair
    body = pd_body(prefill, new_room(), prompt="one two three", max_tokens=2, model="m1")
    _, d = await pd_post(client, prefill, decode, "/v1/completions", body)
    doc = d.json()
    assert doc["object"] == "text_completion" and doc["model"] == "m1"
    assert doc["choices"][0]["text"] == "tok1 tok2"
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 5,
        "completion_tokens": 2,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }
    assert "meta_info" not in doc  # OpenAI routes: no meta_info
    # ...but the weight versions of the answer (utils/weight_versions.py; the real engine's
    # recording, tests/data/sglang_0.5.23_observables.json)
    assert doc["metadata"] == {
        "weight_version": "default",
        "weight_versions": [{"version": "default", "start": 0, "end": 2}],
    }
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    body = pd_body(prefill, new_room(), messages=messages, max_tokens=3)
    _, d = await pd_post(client, prefill, decode, "/v1/chat/completions", body)
    doc = d.json()
    assert doc["object"] == "chat.completion"
    assert doc["choices"][0]["message"]["content"] == "tok1 tok2 tok3"
    assert doc["choices"][0]["message"]["role"] == "assistant"
    assert doc["usage"]["prompt_tokens"] == 4


async def test_openai_streams(pair, client):
    prefill, decode = pair
    messages = [{"role": "user", "content": "hi"}]
    body = pd_body(
        prefill,
        new_room(),
        messages=messages,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    _, d = await pd_post(client, prefill, decode, "/v1/chat/completions", body)
    events = sse_events(d.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == "tok1 tok2"
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    body = pd_body(prefill, new_room(), prompt="a b", max_tokens=3, stream=True)
    _, d = await pd_post(client, prefill, decode, "/v1/completions", body)
    events = sse_events(d.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "tok1 tok2 tok3"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_generate_batch_rooms(pair, client):
    prefill, decode = pair
    rooms = [new_room(), new_room(), new_room()]
    body = pd_body(
        prefill, rooms, text=["a", "b c", "d e f"], sampling_params={"max_new_tokens": 2}
    )
    p, d = await pd_post(client, prefill, decode, "/generate", body)
    assert p.status_code == 200 and d.status_code == 200
    assert isinstance(d.json(), list) and len(d.json()) == 3
    assert [item["meta_info"]["prompt_tokens"] for item in d.json()] == [1, 2, 3]
    for room in rooms:
        assert decode.events.find("slot_freed", room=room)[0]["reason"] == "finished"
        assert decode.events.find("kv_ready", room=room)
        assert prefill.events.find("kv_sent", room=room)
    assert decode.events.find("request_start", rooms=rooms)


async def test_openai_batches(pair, client):
    prefill, decode = pair
    rooms = [new_room(), new_room()]
    body = pd_body(prefill, rooms, prompt=["a b", "c"], max_tokens=1)
    _, d = await pd_post(client, prefill, decode, "/v1/completions", body)
    assert [c["index"] for c in d.json()["choices"]] == [0, 1]
    body = pd_body(prefill, [new_room(), new_room()], input_ids=[[1, 2], [3]], stream=True)
    _, d = await pd_post(client, prefill, decode, "/generate", body)
    events = sse_events(d.text)
    assert {e["index"] for e in events[:-1]} == {0, 1}


async def test_generate_logprobs(pair, client):
    prefill, decode = pair
    body = pd_body(
        prefill,
        new_room(),
        text="w1 w2 w3 w4",
        return_logprob=True,
        top_logprobs_num=2,
        sampling_params={"max_new_tokens": 3},
    )
    p, d = await pd_post(client, prefill, decode, "/generate", body)
    pmeta, dmeta = p.json()["meta_info"], d.json()["meta_info"]
    assert len(pmeta["input_token_logprobs"]) == 4
    assert all(len(t) == 3 and t[2] is None for t in pmeta["input_token_logprobs"])
    # the prompt's first token has no logprob: `[null, id, null]` and a null top list (as the
    # real engine's recording shows)
    assert pmeta["input_token_logprobs"][0][0] is None and pmeta["input_top_logprobs"][0] is None
    assert len(pmeta["input_top_logprobs"]) == 4 and len(pmeta["input_top_logprobs"][1]) == 2
    assert dmeta["input_token_logprobs"] == []
    assert len(dmeta["output_token_logprobs"]) == 3
    assert len(dmeta["output_top_logprobs"]) == 3


async def test_openai_logprobs(pair, client):
    prefill, decode = pair
    body = pd_body(prefill, new_room(), prompt="a b c", max_tokens=2, logprobs=2)
    p, d = await pd_post(client, prefill, decode, "/v1/completions", body)
    lp = d.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["tok1", " tok2"] and len(lp["token_logprobs"]) == 2
    assert len(lp["top_logprobs"][0]) == 2
    # logprobs are in the OpenAI shape only: no meta_info on either leg's answer
    assert "meta_info" not in p.json() and "meta_info" not in d.json()
    assert p.json()["choices"][0]["logprobs"]["tokens"] == ["tok1"]
    messages = [{"role": "user", "content": "x"}]
    body = pd_body(prefill, new_room(), messages=messages, max_tokens=2, logprobs=True)
    _, d = await pd_post(client, prefill, decode, "/v1/chat/completions", body)
    content = d.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["tok1", " tok2"]


async def test_prefill_registration_can_precede_prefill_request(pair, client):
    """The decode may register before the prefill request arrives; the KV still flows."""
    prefill, decode = pair
    room = new_room()
    body = pd_body(prefill, room, text="a b")
    async with trio.open_nursery() as nursery:
        results = {}

        async def post_decode():
            results["d"] = await client.post(decode.url + "/generate", json=body)

        nursery.start_soon(post_decode)
        await decode.events.wait_for("slot_acquired", room=room)
        assert room in prefill.rooms  # registered at the bootstrap server
        p = await client.post(prefill.url + "/generate", json=body)
    assert p.status_code == 200 and results["d"].status_code == 200
