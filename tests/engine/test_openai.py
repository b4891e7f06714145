"""OpenAI routes as SGLang serves them (serving_chat.py, serving_completions.py, protocol.py):
no top-level meta_info; an abort is a choice's finish_reason, an error an HTTP status or an
`{"error": {...}}` chunk; a stream's headers go out with its first chunk."""

from __future__ import annotations

import trio

from .helpers import Background, new_room, pd_body, pd_post, sse_events, start_engine

CHAT = [{"role": "user", "content": "hi"}]


def no_meta(doc: dict) -> bool:
    return "meta_info" not in doc and all("meta_info" not in c for c in doc.get("choices", []))


async def test_openai_streams_send_headers_with_their_first_chunk(nursery, client):
    """/generate answers 200 before any work; chat and completions kick-start their generator
    first, so a PD decode sends nothing until the KV arrived and a token exists."""
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    for path, extra in (
        ("/v1/chat/completions", {"messages": CHAT}),
        ("/v1/completions", {"prompt": "a"}),
    ):
        room = new_room()
        body = pd_body(prefill, room, stream=True, max_tokens=2, **extra)
        async with trio.open_nursery() as inner:
            got: dict[str, int] = {}

            async def stream(body=body, path=path, got=got) -> None:
                async with client.stream("POST", decode.url + path, json=body) as response:
                    got["status"] = response.status_code
                    await response.aread()

            inner.start_soon(stream)
            await decode.events.wait_for("slot_acquired", room=room)
            await trio.sleep(0.3)
            assert "status" not in got and not decode.events.find("response_start", room=room)
            await client.post(prefill.url + path, json=body)
        assert got["status"] == 200
        started = decode.events.find("response_start", room=room)[0]
        assert started["t"] >= decode.events.find("first_token", room=room)[0]["t"]


async def test_an_abort_with_a_status_on_openai_routes(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", waiting_timeout=0.3)
    body = pd_body(prefill, new_room(), messages=CHAT)
    r = await client.post(decode.url + "/v1/chat/completions", json=body)
    assert r.status_code == 500 and r.json()["object"] == "error" and r.json()["code"] == 500
    assert "KVPoll.WaitingForInput" in r.json()["message"]
    body = pd_body(
        prefill, new_room(), messages=CHAT, stream=True, stream_options={"include_usage": True}
    )
    r = await client.post(decode.url + "/v1/chat/completions", json=body)
    events = sse_events(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert events[0]["error"]["code"] == 500
    assert events[0]["error"]["type"] == "INTERNAL_SERVER_ERROR"
    assert events[1]["choices"] == [] and "usage" in events[1]  # then the usage chunk
    assert all(no_meta(e) for e in events[:-1])


async def test_a_graceful_abort_is_only_a_finish_reason(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", inter_token_ms=50.0)
    room = new_room()
    body = pd_body(prefill, room, messages=CHAT, max_tokens=100, rid="oa")
    async with trio.open_nursery() as inner:
        bg = Background(inner, client)
        bg.post("d", decode, body, rid="h", path="/v1/chat/completions")
        bg.post("p", prefill, body, rid="h", path="/v1/chat/completions")
        await decode.events.wait_for("first_token", room=room)
        await client.post(decode.url + "/abort_request", json={"rid": "oa"})
    doc = bg.results["d"].json()
    assert bg.results["d"].status_code == 200
    assert doc["choices"][0]["finish_reason"] == "abort" and no_meta(doc)
    assert doc["id"] == "oa" and doc["usage"]["completion_tokens"] >= 1


async def test_stream_chunk_shapes(pair, client):
    prefill, decode = pair
    body = pd_body(prefill, new_room(), messages=CHAT, stream=True, max_tokens=2, logprobs=True)
    _, d = await pd_post(client, prefill, decode, "/v1/chat/completions", body)
    chunks = sse_events(d.text)[:-1]
    assert chunks[0]["choices"][0]["delta"] == {
        "reasoning_content": None,
        "role": "assistant",
        "content": "",
    }
    assert "usage" not in chunks[0]  # msgspec omits the default
    content = [c for c in chunks if c["choices"][0]["delta"].get("content")]
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in content] == [
        "tok1",
        " tok2",
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"][0]["delta"] == {"reasoning_content": None}
    assert all(no_meta(c) for c in chunks)
    body = pd_body(prefill, new_room(), prompt="a", stream=True, max_tokens=2)
    _, d = await pd_post(client, prefill, decode, "/v1/completions", body)
    chunks = sse_events(d.text)[:-1]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    assert all(c["usage"] is None and no_meta(c) for c in chunks)
