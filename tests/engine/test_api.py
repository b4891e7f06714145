"""Info endpoints, error answers, the event log and its file."""

from __future__ import annotations

import orjson
import pytest
import trio

from trio_pd_testing.engine import EventLog

from .helpers import new_room, pd_body, pd_post, start_engine


async def test_info_endpoints(pair, client):
    prefill, decode = pair
    for engine in (prefill, decode):
        assert (await client.get(engine.url + "/health")).status_code == 200
        assert (await client.get(engine.url + "/health_generate")).status_code == 200
        assert (await client.post(engine.url + "/flush_cache")).status_code == 200
        info = (await client.get(engine.url + "/model_info")).json()
        assert info["model_path"] == info["served_model_name"] == "sim-model"
        assert info["disaggregation_mode"] == engine.role and info["is_generation"] is True
        assert (await client.get(engine.url + "/get_model_info")).json() == info
        models = (await client.get(engine.url + "/v1/models")).json()
        assert models["data"][0]["id"] == "sim-model"
        assert models["data"][0]["owned_by"] == "sglang"
        server = (await client.get(engine.url + "/server_info")).json()
        assert server["disaggregation_mode"] == engine.role
        assert (await client.get(engine.url + "/get_load")).status_code == 404
    assert prefill.bootstrap_port and decode.bootstrap_port is None
    assert prefill.url == f"http://127.0.0.1:{prefill.port}"


async def test_error_answers(pair, client):
    """In FastAPI's and SGLang's shapes: 404/405 `detail`, 400 validation `ErrorResponse`."""
    prefill, decode = pair
    r = await client.get(decode.url + "/nope")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    r = await client.post(decode.url + "/generate", content=b"{not json")
    assert r.status_code == 400 and "JSON decode error" in r.json()["message"]
    assert r.json()["object"] == "error" and r.json()["type"] == "Bad Request"
    r = await client.post(decode.url + "/generate", content=b"[1, 2]")
    assert r.status_code == 400 and r.json()["code"] == 400
    r = await client.get(decode.url + "/generate")
    assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"}
    r = await client.post(prefill.url + "/v1/chat/completions", json=pd_body(prefill, 1))
    assert r.status_code == 400 and "messages" in r.json()["message"]
    # the OpenAI routes want a JSON content type (validate_json_request)
    r = await client.post(
        prefill.url + "/v1/completions",
        content=b'{"prompt": "a"}',
        headers={"content-type": "text/plain"},
    )
    assert r.status_code == 400 and "Unsupported Media Type" in r.json()["message"]
    r = await client.get(decode.url + "/v1/models/sim-model")
    assert r.status_code == 200 and r.json()["id"] == "sim-model"
    r = await client.get(decode.url + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_event_log_file_and_queries(nursery, client, tmp_path):
    path = tmp_path / "decode.jsonl"
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", events_path=str(path))
    room = new_room()
    await pd_post(client, prefill, decode, "/generate", pd_body(prefill, room, text="a"))
    end = await decode.events.wait_for("request_end", room=room)
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [r["event"] for r in lines] == [r["event"] for r in decode.events.records]
    assert lines[-1] == end
    for record in lines:
        assert {"event", "t", "wall", "role", "rid", "room"} <= record.keys()
        assert record["role"] == "decode"
    assert decode.events.find(event="slot_freed", room=room, reason="finished")
    assert not decode.events.find(event="slot_freed", room=room + 1)
    with pytest.raises(trio.TooSlowError):
        await decode.events.wait_for("slot_freed", timeout=0.05, room=room + 1)


async def test_event_log_wait_for_future_record():
    log = EventLog("decode", maxlen=3)

    async def later():
        await trio.sleep(0.01)
        log.emit("x", room=1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(later)
        record = await log.wait_for("x", timeout=2, room=1)
    assert record["event"] == "x" and record["role"] == "decode"
    for i in range(5):
        log.emit("y", room=i)
    assert len(log.records) == 3  # bounded
